"""Tensor <-> raw bytes without copies, plus the header checks both ends share."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from shared.errors import IntegrityError
from shared.wire.schemas import TensorHeader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's storage (no copy)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).reshape(-1).numpy()


def empty_like_header(header: TensorHeader) -> torch.Tensor:
    """The receiver's own buffer for `header`'s tensor: uint8 [nbytes], viewed later."""
    return torch.empty(header.nbytes, dtype=torch.uint8)


def checksum(buf: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def header_for(context_id: str, layer: int, kind: str, t: torch.Tensor) -> TensorHeader:
    raw = as_bytes(t)
    return TensorHeader(
        context_id=context_id, layer=layer, kind=kind, shape=list(t.shape), dtype=dtype_name(t.dtype),
        nbytes=raw.nbytes, checksum=checksum(raw),
    )


def tensor_from(buf: torch.Tensor, header: TensorHeader) -> torch.Tensor:
    """Verify `buf` (uint8, just received) against `header`; return it viewed as the tensor."""
    if header.dtype not in DTYPES:
        raise IntegrityError(f"unknown dtype {header.dtype!r} in header")
    got = checksum(buf.numpy())
    if got != header.checksum:
        raise IntegrityError(f"checksum mismatch for layer {header.layer} {header.kind}: {got} != {header.checksum}")
    t = buf.view(DTYPES[header.dtype])
    numel = 1
    for d in header.shape:
        numel *= d
    if t.numel() != numel:
        raise IntegrityError(f"layer {header.layer} {header.kind}: {t.numel()} elements, header shape {header.shape}")
    return t.reshape(header.shape)
