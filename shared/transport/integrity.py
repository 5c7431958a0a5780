"""The checksum a `TensorHeader` carries of its encoded payload, computed alike by both ends.

Called by a sender serving a pull (`answer.answer`, once per stored tensor) and by every channel's
receiver as an item lands, on whatever thread holds the payload; both block while they hash.
Integrity: the checksum is a function of where the payload's bytes are, and both ends hold them
in the same kind of memory (device payloads only travel when both ends agreed, see "Raw and CUDA
tensors" in `codecs.py`):
  - host bytes: xxh3-64, as always;
  - device bytes: `device_checksum`, two 64-bit sums over the bytes as int64 words, plain and
    position-weighted (Fletcher-style), with torch integer ops on the GPU. Copying each payload
    to the host to hash it would cost more than the device-to-device pull it checks. Integer sums
    wrap the same way in any order, so the result does not depend on the reduction order. It
    catches truncated, zero-filled, shifted or stale payloads and isolated corruption; like
    xxh3 it is no defence against a sender that lies. The sender computes it once per stored
    tensor (`answer.answer` caches it), and reading it waits for the kernels queued before it on
    the current stream: the capture's writes are complete before UCX reads the tensor (DroidMesh
    runs its engine on the default stream).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash


def checksum(payload: torch.Tensor) -> str:
    """Of a uint8 payload: `device_checksum` for device bytes, else xxh3-64 of the host bytes."""
    if payload.device.type == "cuda":
        return device_checksum(payload)
    buf: Any = payload.numpy()
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(buf).data)


_MASK64 = (1 << 64) - 1
_WEIGHTED_WORDS = 1 << 24  # int64 words per step of the weighted sum: bounds its temporaries to 256 MiB


def device_checksum(payload: torch.Tensor) -> str:
    """(sum of w, sum of (i + 1) * w) mod 2**64 over the uint8 payload read as int64 words w
    (the last one zero-padded), on the payload's own device; "d" + 32 hex digits."""
    if payload.numel() % 8 or payload.storage_offset() % 8:  # an int64 view needs whole, aligned words
        payload = torch.cat([payload, payload.new_zeros(-payload.numel() % 8)])
    words = payload.view(torch.int64)
    weighted = words.new_zeros(())
    for start in range(0, words.numel(), _WEIGHTED_WORDS):
        chunk = words[start:start + _WEIGHTED_WORDS]
        weighted += (chunk * torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device)).sum()
    plain, weighted_sum = torch.stack([words.sum(), weighted]).tolist()  # one device-to-host read
    return f"d{plain & _MASK64:016x}{weighted_sum & _MASK64:016x}"
