"""Where a receiver lands an item's payload before its codec decodes it into the item's buffer.

Called by `bulk` (the receiving side of every channel) for each header of a pull's response,
after the header's size was checked against its codec's `max_nbytes`; it only allocates. A raw
payload lands straight in the destination buffer when its bytes are the buffer's own; device
payloads (`codecs.DEVICE_PARAM`) stage on the buffer's device; a host payload bound for a CUDA
buffer stages in pinned memory.
"""

from __future__ import annotations

from typing import Literal

import torch

from droidmesh.shared.kv import streams
from droidmesh.shared.transport.codecs import Codec, RawCodec, asks_device, payload_view
from droidmesh.shared.wire.schemas import TensorHeader

Place = Literal["out", "device", "pinned", "host"]


def receive_place(codec: Codec, header: TensorHeader, out: torch.Tensor) -> Place:
    """Where every channel lands `header`'s (checked) payload for `out`:
    "out" (its own bytes: raw into a contiguous buffer, sent as device memory when `out` is on
    CUDA), "device" (a staging buffer on `out`'s device), "pinned" (pinned host staging, for a
    host payload bound for a CUDA buffer) or "host" (pageable host staging, for a CPU buffer)."""
    fits = isinstance(codec, RawCodec) and out.is_contiguous() and header.nbytes == out.nbytes
    if asks_device(header.codec_params):
        return "out" if fits else "device"
    if out.is_cuda:
        return "pinned"
    return "out" if fits else "host"


def receive_buffer(codec: Codec, header: TensorHeader, out: torch.Tensor) -> torch.Tensor:
    """The uint8 [header.nbytes] buffer `receive_place` names."""
    return buffer_at(receive_place(codec, header, out), header, out)


def buffer_at(place: Place, header: TensorHeader, out: torch.Tensor) -> torch.Tensor:
    """The uint8 [header.nbytes] buffer at `place` for `out` (`receive_place`'s answer)."""
    if place == "out":
        return payload_view(out)
    if place == "device":
        return streams.empty((header.nbytes,), torch.uint8, out.device)
    return torch.empty(header.nbytes, dtype=torch.uint8, pin_memory=place == "pinned")
