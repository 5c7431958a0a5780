"""Wire codecs: how one tensor travels as bytes, and the registry a receiver decodes from.

A `Codec` (stateless; both methods block while they compute, on whatever thread calls them):
  - `encode(t, params)`        sender, serving a pull: tensor -> (uint8 CPU payload, params as sent)
  - `decode(payload, header, out)`  receiver, as the item lands: write the decoded tensor into
                               `out`, the caller's buffer (its shape, dtype and device)
  - `max_nbytes(shape, dtype, params)`  receiver, before receiving: the largest payload a
                               well-behaved sender can send for that tensor. A header claiming more
                               is refused before any buffer is allocated for it.
Only `raw` (the tensor's own bytes, no copy on either side when the buffer is on the CPU) ships
with this module; `register` adds more (compressed codecs plug in here, nothing else changes).
Both ends share `checksum` (xxh3-64 of the payload) and `payload_view`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from shared.errors import IntegrityError
from shared.wire.schemas import CodecParams, TensorHeader


class Codec(Protocol):
    name: str

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]: ...

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None: ...

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int: ...


_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> None:
    """Make `codec` available to both ends of every bulk channel in this process."""
    _REGISTRY[codec.name] = codec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Codec:
    """The registered codec `name`; `IntegrityError` for one this build does not know."""
    codec = _REGISTRY.get(name)
    if codec is None:
        raise IntegrityError(f"unknown codec {name!r}; this build knows {sorted(_REGISTRY)}")
    return codec


def names() -> list[str]:
    return sorted(_REGISTRY)


def payload_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage [nbytes] (no copy)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).reshape(-1)  # [numel * itemsize]


def checksum(payload: torch.Tensor) -> str:
    """xxh3-64 of a CPU uint8 payload's bytes."""
    buf: Any = payload.numpy() if payload.device.type == "cpu" else payload.cpu().numpy()
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(buf).data)


def nbytes_of(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize


class RawCodec:
    """The tensor's own bytes. Decoding into a CPU buffer needs no copy at all: channels receive
    straight into `out` (see `direct_view`)."""

    name = "raw"

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        return payload_view(t if t.device.type == "cpu" else t.cpu()), {}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        if payload.numel() != nbytes_of(out.shape, out.dtype):
            raise IntegrityError(f"layer {header.layer} {header.kind}: {payload.numel()} bytes for {list(out.shape)}")
        target = payload_view(out)
        if target.data_ptr() != payload.data_ptr():  # not received in place (e.g. a GPU buffer)
            target.copy_(payload, non_blocking=False)

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        return nbytes_of(shape, dtype)


def direct_view(codec: Codec, out: torch.Tensor) -> torch.Tensor | None:
    """Where a channel may receive `codec`'s payload for `out` straight into `out` (raw into a
    contiguous CPU buffer), the uint8 view to receive into; else None (stage, then decode)."""
    if isinstance(codec, RawCodec) and out.device.type == "cpu" and out.is_contiguous():
        return payload_view(out)
    return None


register(RawCodec())
