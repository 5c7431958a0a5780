"""Quantized KV / E tensors as one flat uint8 payload: int8 (KIVI-style) and int4 (group-wise).

Pure tensor code (torch only): every function works on the device of the tensor it is given and
takes the output dtype from the caller's `out`; nothing is implicit. The wire codecs
(`shared/transport/codecs.py`) wrap these functions; `kind` is the item's kind, "K", "V" or "E".

int8, symmetric, one float32 scale per reduction slice (`scale = max|x| / 127`, q = round(x / scale)
in [-127, 127]; a slice of zeros has scale 0 and decodes to zeros):
  - K [1, kvh, T, hd]: per channel, one scale per (head, dim) over the tokens (keys have outlier
    channels: KIVI, Liu et al. 2024); scales [1, kvh, 1, hd];
  - V [1, kvh, T, hd]: per token, one scale per (head, token) over the dims; scales [1, kvh, T, 1];
  - E [1, T, D]: per token and group of 32 consecutive dims (`int8_e_group`), one scale each;
    scales [1, T, D / g, 1]. A hidden state has a few massive channels (~50x the median |x| on
    every SmolLM2 token, ~10,000x on the first): one scale per token would spend its 255 steps on
    them and round every other channel of that token coarsely (2.7 % relative error against 1.0 %
    in groups of 32 on a real model's layer-14 input, at 1/8 more scale bytes). Where 32 does not
    divide D, one scale per token; where it does (and D > 32) the size differs from per token's,
    so a peer that laid E out per token is refused by the size check, never misread.
  Bound: |x - x_hat| <= scale / 2, plus float32 rounding of x / scale (at most 2**-22 |x|) and the
  rounding of x_hat to the output dtype (half an ulp: at most u |x_hat| with the dtype's unit
  roundoff u = 2**-24 for float32, 2**-8 for bfloat16, 2**-11 for float16; for bfloat16 that term
  alone reaches 127 * 2**-8 scale ~ scale / 2, so the bound there is about one scale).

int4, asymmetric, per group of `group` values: lo, hi = min, max of the group, `scale = (hi -
lo) / 15`, q = round((x - lo) / scale) in [0, 15], x_hat = lo + q * scale (the zero point is the
group's minimum itself, kept in float32, so a group's minimum decodes exactly; a constant group
has scale 0 and decodes exactly). The groups, by kind (`None`: as V):
  - V, E: `group` consecutive values along the last dim (`group` divides it; `default_group`: 32,
    or gcd(32, last dim) where 32 does not divide it);
  - K [..., T, hd]: per channel, `group` consecutive tokens of one (head, dim), the last group of
    each channel holding the T mod group tokens left (KIVI's layout for keys, as int8's: their
    outlier channels would set every token-group's range; on a real model's K, 0.045 relative
    error against 0.134 per token at group 64). Values travel in the order of K transposed,
    [..., hd, T]; the scales and minima per channel, its groups in token order.
  Bound: |x - x_hat| <= scale / 2, plus float32 rounding (a few ulp of max(|lo|, |hi|)) and the
  rounding to the output dtype, as for int8.

Payload layout (bytes, float32 in the host's byte order: little-endian everywhere DroidMesh runs):
  int8  [numel] q as int8 (two's complement), x's C order | zero padding to a multiple of 4 |
        [n_scales * 4] scales, float32, C order of the scales' shape above
  int4  [ceil(numel / 2)] q, two per byte: value 2i in the low nibble, 2i + 1 in the high one
        (an odd numel pads the last high nibble with 0) | zero padding to a multiple of 4 |
        [n_groups * 4] scales, float32 | [n_groups * 4] zero points (group minima), float32;
        groups in C order; n_groups = numel / group (K: channels x ceil(T / group))
The size is a function of (shape, kind) for int8 and (shape, group, kind) for int4 only: `int8_nbytes`,
`int4_nbytes` are exact. Bad input (a kind or group that does not fit the shape, a payload of
another size, scales that are negative or would decode to a non-finite value) raises
`IntegrityError` before `out` is written.
"""

from __future__ import annotations

import math

import torch

from droidmesh.shared.errors import IntegrityError

KINDS = ("K", "V", "E")
INT4_DEFAULT_GROUP = 32
INT8_E_GROUP = 32  # E's int8 scales: one per token and 32 dims
MAX_TOKEN_GROUP = 1024  # int4 K: tokens of one channel sharing a scale
_INT8_MAX = 127
_INT4_MAX = 15


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _align4(n: int) -> int:
    return (n + 3) & ~3


# -- int8 --------------------------------------------------------------------------------------
def int8_axis(kind: str, ndim: int) -> int:
    """The axis int8 reduces over for `kind`, in `int8_view`'s shape: tokens (-2) for K
    (per-channel scales), the last dim (-1) for V (per token) and E (per token and group)."""
    if kind not in KINDS:
        raise IntegrityError(f"int8: kind {kind!r} is not one of {KINDS}")
    axis = -2 if kind == "K" else -1
    if ndim < -axis:
        raise IntegrityError(f"int8: a {kind} tensor needs at least {-axis} dims, got {ndim}")
    return axis


def int8_e_group(last: int) -> int:
    """E's int8 group along its last dim of `last`: INT8_E_GROUP (32) where it divides `last` (every
    hidden size here), else the whole dim (one scale per token)."""
    return INT8_E_GROUP if last and int(last) % INT8_E_GROUP == 0 else max(int(last), 1)


def int8_view(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The shape a `kind` tensor of `shape` is reduced in: `shape` itself for K and V; E
    [..., D] as [..., D / g, g], g = `int8_e_group(D)`."""
    int8_axis(kind, len(shape))
    if kind != "E":
        return tuple(shape)
    g = int8_e_group(shape[-1])
    return (*shape[:-1], int(shape[-1]) // g, g)


def int8_scale_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """`int8_view(shape)` with the reduced axis set to 1: K [..., 1, hd], V [..., 1],
    E [..., D / g, 1]."""
    view = int8_view(shape, kind)
    out = list(view)
    out[int8_axis(kind, len(view))] = 1
    return tuple(out)


def int8_nbytes(shape: tuple[int, ...], kind: str) -> int:
    """Exact int8 payload size of a `kind` tensor of `shape`."""
    return _align4(_numel(shape)) + 4 * _numel(int8_scale_shape(shape, kind))


def int8_quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """`x` (a float tensor) as an int8 payload, uint8 [int8_nbytes(x.shape, kind)] on x.device."""
    _check_float(x, "int8")
    view = int8_view(tuple(x.shape), kind)
    axis = int8_axis(kind, len(view))
    xf = x.float().reshape(view)  # [view] float32: exact for bf16 / fp16; x itself (viewed) for float32
    if x.numel():
        scale = xf.abs().amax(dim=axis, keepdim=True) / _INT8_MAX  # [scale shape]: max |x| / 127
    else:
        scale = xf.new_zeros(int8_scale_shape(tuple(x.shape), kind))
    _check_finite_scales(scale, "int8")
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)  # [scale shape]: a zero slice stays zero
    n = x.numel()
    payload = torch.zeros(int8_nbytes(tuple(x.shape), kind), dtype=torch.uint8, device=x.device)
    scaled = xf.mul_(inv) if _owned(xf, x) else xf * inv  # [view] float32: in place when xf is already a copy
    payload[:n].view(torch.int8).view(view).copy_(scaled.round_().clamp_(-_INT8_MAX, _INT8_MAX))  # [view] int8
    _f32_section(payload, _align4(n), scale.numel()).copy_(scale.reshape(-1))  # [n_scales]
    return payload


def int8_dequantize(payload: torch.Tensor, kind: str, out: torch.Tensor) -> None:
    """Decode an int8 payload of a `kind` tensor into `out` (its shape, dtype and device); a host
    payload is staged on out.device first."""
    _check_out(out, "int8")
    shape = tuple(out.shape)
    _check_size(payload, int8_nbytes(shape, kind), "int8")
    payload = _on(payload, out.device)
    n = out.numel()
    scale_shape = int8_scale_shape(shape, kind)
    scale = _f32_section(payload, _align4(n), _numel(scale_shape)).view(scale_shape)  # [scale shape]
    peak = float(scale.amax()) * _INT8_MAX if scale.numel() else 0.0
    _check_scales(scale, peak, out.dtype, "int8")
    view = int8_view(shape, kind)
    q = payload[:n].view(torch.int8).view(view)  # [view] int8
    if out.is_contiguous():
        torch.mul(q, scale, out=out.view(view))  # [view]: computed in float32, rounded once to out.dtype
    else:
        out.copy_((q * scale).view(shape))  # [view] -> [shape]


# -- int4 --------------------------------------------------------------------------------------
def check_group(shape: tuple[int, ...], group: object, kind: str | None = None) -> int:
    """`group` as an int if it is a valid int4 group for a `kind` tensor of `shape` (K: an int in
    [1, MAX_TOKEN_GROUP] tokens; otherwise one in [1, last dim] that divides the last dim), else
    `IntegrityError`."""
    if not shape:
        raise IntegrityError("int4: a scalar has no last dim to group")
    if isinstance(group, bool) or not isinstance(group, int):
        raise IntegrityError(f"int4: group {group!r} is not an integer")
    if kind == "K":
        if len(shape) < 2 or not 1 <= group <= MAX_TOKEN_GROUP:
            raise IntegrityError(f"int4: a K group of {group} tokens (1..{MAX_TOKEN_GROUP}) over a {len(shape)}-dim K")
        return group
    last = int(shape[-1])
    if not 1 <= group <= max(last, 1) or last % group:
        raise IntegrityError(f"int4: group {group} does not divide the last dim {last}")
    return group


def default_group(shape: tuple[int, ...]) -> int:
    """The int4 group when none is asked for: gcd(INT4_DEFAULT_GROUP, last dim), i.e. 32 for any
    last dim that is a multiple of 32 (head dims 64 / 128, hidden sizes) and the largest power
    of two dividing it otherwise (16 for a tiny model's head dim of 16)."""
    return math.gcd(INT4_DEFAULT_GROUP, int(shape[-1])) if shape and shape[-1] else 1


def _int4_groups(shape: tuple[int, ...], group: int, kind: str | None) -> tuple[int, int, int]:
    """(rows, row length, groups per row) of the layout: K as [channels, T] in groups of `group`
    tokens (the last one shorter), anything else as [numel / group, group]."""
    if kind == "K":
        tokens = int(shape[-2])
        return _numel(shape) // tokens if tokens else _numel(shape[:-2]) * int(shape[-1]), tokens, -(-tokens // group)
    n = _numel(shape)
    return n // group, group, 1


def int4_nbytes(shape: tuple[int, ...], group: int, kind: str | None = None) -> int:
    """Exact int4 payload size of a `kind` tensor of `shape` in groups of `group`."""
    group = check_group(shape, group, kind)
    rows, _, per_row = _int4_groups(shape, group, kind)
    return _align4((_numel(shape) + 1) // 2) + 8 * rows * per_row


def _grouped(x: torch.Tensor, kind: str | None, rows: int, length: int, per_row: int, size: int) -> torch.Tensor:
    """x as the layout's groups, [rows, per_row, group] float32: K transposed to [channels, T] and
    its last group filled up with the channel's last value (so its range is its own tokens')."""
    xf = x.float()  # [shape] float32: exact for bf16 / fp16, x itself for float32
    xr = (xf.transpose(-1, -2) if kind == "K" else xf).reshape(rows, length)  # [rows, length]
    padded = per_row * size
    if padded > length:
        xr = torch.cat([xr, xr[:, -1:].expand(rows, padded - length)], 1)  # [rows, padded]
    return xr.view(rows, per_row, size)


def _slot(group: int, length: int, per_row: int) -> int:
    """Values a group occupies in the padded rows: `group`, or the row itself where one group holds
    it (a K shorter than its group: a peer's group of 1024 over 1 token allocates 1 value, not 1024)."""
    return group if per_row > 1 else length


def int4_quantize(x: torch.Tensor, group: int, kind: str | None = None) -> torch.Tensor:
    """`x` (a float tensor) as an int4 payload, uint8 [int4_nbytes(x.shape, group, kind)] on x.device."""
    _check_float(x, "int4")
    group = check_group(tuple(x.shape), group, kind)
    n = x.numel()
    payload = torch.zeros(int4_nbytes(tuple(x.shape), group, kind), dtype=torch.uint8, device=x.device)
    if n == 0:
        return payload
    rows, length, per_row = _int4_groups(tuple(x.shape), group, kind)
    xg = _grouped(x, kind, rows, length, per_row, _slot(group, length, per_row))  # [rows, per_row, slot]
    lo = xg.amin(dim=2, keepdim=True)  # [rows, per_row, 1]
    hi = xg.amax(dim=2, keepdim=True)  # [rows, per_row, 1]
    scale = (hi - lo) / _INT4_MAX  # [rows, per_row, 1]
    _check_finite_scales(scale, "int4")
    _check_finite_scales(lo, "int4")
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)  # [rows, per_row, 1]: a constant group is all q = 0
    scaled = xg.sub_(lo) if _owned(xg, x) else xg - lo  # [rows, per_row, group]: in place when xg is already a copy
    q = scaled.mul_(inv).round_().clamp_(0, _INT4_MAX).to(torch.uint8)  # [rows, per_row, group] in [0, 15]
    q = q.view(rows, -1)[:, :length].reshape(-1)  # [numel]: K's filler dropped
    packed = payload[:(n + 1) // 2]  # [ceil(numel / 2)]
    packed[: n - n // 2].copy_(q[0::2])  # even values: low nibbles
    packed[: n // 2].bitwise_or_(q[1::2] << 4)  # odd values: high nibbles
    start, groups = _align4((n + 1) // 2), rows * per_row
    _f32_section(payload, start, groups).copy_(scale.reshape(-1))  # [n_groups]
    _f32_section(payload, start + 4 * groups, groups).copy_(lo.reshape(-1))  # [n_groups]
    return payload


def int4_dequantize(payload: torch.Tensor, group: int, out: torch.Tensor, kind: str | None = None) -> None:
    """Decode an int4 payload of a `kind` tensor into `out` (its shape, dtype and device); a host
    payload is staged on out.device first."""
    _check_out(out, "int4")
    shape = tuple(out.shape)
    _check_size(payload, int4_nbytes(shape, group, kind), "int4")
    payload = _on(payload, out.device)
    n = out.numel()
    if n == 0:
        return
    rows, length, per_row = _int4_groups(shape, group, kind)
    start, groups = _align4((n + 1) // 2), rows * per_row
    scale = _f32_section(payload, start, groups).view(rows, per_row, 1)  # [rows, per_row, 1]
    lo = _f32_section(payload, start + 4 * groups, groups).view(rows, per_row, 1)  # [rows, per_row, 1]
    top = lo + scale * _INT4_MAX  # [rows, per_row, 1]: the largest value a group decodes to, in the decode's own float32 ops
    peak = float(torch.maximum(lo.abs(), top.abs()).amax()) if groups else 0.0
    _check_scales(scale, peak, out.dtype, "int4")
    slot = _slot(group, length, per_row)
    padded = per_row * slot  # K: room for each channel's last group's filler
    q = torch.zeros(rows, padded, dtype=torch.float32, device=out.device)  # [rows, padded]
    q[:, :length].copy_(_nibbles(payload[:(n + 1) // 2])[:n].view(rows, length))  # values in [0, 15]
    xr = q.view(rows, per_row, slot).mul_(scale).add_(lo)  # [rows, per_row, slot] float32: lo + q * scale
    xr = xr.view(rows, padded)[:, :length]  # [rows, length]
    if kind == "K":  # [channels, T] -> [..., hd, T] -> [..., T, hd]
        out.copy_(xr.reshape(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2))
    else:
        out.copy_(xr.reshape(shape))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [m] -> uint8 [2 m]: value 2i from the low nibble of byte i, 2i + 1 from the high one."""
    return torch.stack([packed & 0xF, packed >> 4], 1).view(-1)  # [m, 2] -> [2 m]


# -- checks and helpers --------------------------------------------------------------------------
def _check_float(x: torch.Tensor, codec: str) -> None:
    if not x.dtype.is_floating_point:
        raise IntegrityError(f"{codec}: encodes floating-point tensors, got {x.dtype}")


def _check_out(out: torch.Tensor, codec: str) -> None:
    if not out.dtype.is_floating_point:
        raise IntegrityError(f"{codec}: decodes into floating-point tensors, got {out.dtype}")


def _check_size(payload: torch.Tensor, expected: int, codec: str) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise IntegrityError(f"{codec}: payload of {payload.numel()} {payload.dtype} values, the layout needs "
                             f"{expected} bytes")


def _check_finite_scales(scale: torch.Tensor, codec: str) -> None:
    """Sender side: a NaN / inf in the tensor shows as a non-finite scale or minimum."""
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        raise IntegrityError(f"{codec}: the tensor holds NaN or inf; refusing to encode it")


def _check_scales(scale: torch.Tensor, peak: float, dtype: torch.dtype, codec: str) -> None:
    """Receiver side, before `out` is written: scales finite and >= 0, and the largest decodable
    |value| (`peak`, NaN if a scale or zero point is NaN) finite in `dtype`, so the decode cannot
    produce NaN or inf."""
    if scale.numel() and not bool((scale >= 0).all()):  # False for NaN too
        raise IntegrityError(f"{codec}: negative or NaN scales")
    if not peak <= torch.finfo(dtype).max:  # False for NaN
        raise IntegrityError(f"{codec}: decoded values would reach {peak}, beyond {dtype}'s range")


def _owned(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `t` (derived from `x`) has storage of its own, so it may be overwritten."""
    return t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def _f32_section(payload: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """float32 [count] view of payload[start : start + 4 count]; a copy if it is misaligned, which
    only a received payload viewed at an odd offset can be (the encoders write fresh payloads)."""
    section = payload[start:start + 4 * count]  # [4 count] uint8
    if (section.storage_offset() % 4) and count:
        section = section.clone()  # a view of a misaligned float needs its own storage
    return section.view(torch.float32)  # [count]


def _on(payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`payload` on `device`: a host payload bound for a CUDA buffer is copied once (asynchronously
    from pinned memory; the dequantize kernels that read it are queued after the copy)."""
    if payload.device == device:
        return payload
    return payload.to(device, non_blocking=payload.device.type == "cpu" and payload.is_pinned())
