"""Data of the numeric core: one layer's KV (`KVBlock`) and a sender's captured context.

Shapes (batch is always 1 on the sharing path):
  K, V  [1, kv_heads, T, head_dim]   keys after RoPE, at positions 0..T-1
  E_l   [1, T, hidden]               the hidden state entering layer l
"""

from __future__ import annotations

import dataclasses

import torch

from droidmesh.shared.errors import BadRequestError, CacheLayoutError, IntegrityError
from droidmesh.shared.model.device import same_device
from droidmesh.shared.model.fingerprint import ArchFingerprint
from droidmesh.shared.wire.hashing import PUBLIC, common_prefix


@dataclasses.dataclass(frozen=True)
class KVBlock:
    """Layer `layer`'s keys and values for a context."""

    layer: int
    k: torch.Tensor  # [1, kv_heads, T, head_dim]
    v: torch.Tensor  # [1, kv_heads, T, head_dim]

    @property
    def tokens(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.k) + tensor_nbytes(self.v)


@dataclasses.dataclass(frozen=True)
class CapturedContext:
    """What a sender keeps for one prefilled context: KV of every layer, E of chosen layers."""

    token_ids: tuple[int, ...]
    fingerprint: ArchFingerprint
    model_name: str
    kv: tuple[KVBlock, ...]  # one per layer, in layer order
    e: dict[int, torch.Tensor]  # layer -> E_layer [1, T, hidden]
    # (maps sha256, layer, kind) -> SCD codes of that item for the whole context, encoded once
    # when stored (`codecs.LowRankCodec.prepare`): [H, T, r] for K / V, [T, r] for E
    codes: dict[tuple[str, int, str], torch.Tensor] = dataclasses.field(default_factory=dict)
    scope: str = PUBLIC  # who may reuse it (`shared.wire.hashing`): announced with it, seeds its id

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    @property
    def nbytes(self) -> int:
        """Bytes held: all K/V plus the captured E tensors and any prepared codes."""
        return (sum(b.nbytes for b in self.kv) + sum(tensor_nbytes(t) for t in self.e.values())
                + sum(tensor_nbytes(t) for t in self.codes.values()))

    def kv_nbytes(self) -> list[int]:
        return [b.nbytes for b in self.kv]

    def items(self) -> list[torch.Tensor]:
        """The K / V / E tensors in layer order (per layer K, V, then E when captured): the
        order a bulk channel lays a stored context out in (`with_items` takes them back)."""
        out = []
        for block in self.kv:
            out += [block.k, block.v] + ([self.e[block.layer]] if block.layer in self.e else [])
        return out + [self.e[l] for l in sorted(self._loose_e())]

    def with_items(self, tensors: list[torch.Tensor]) -> CapturedContext:
        """This context with its K / V / E replaced by `tensors`, in `items()` order and shapes."""
        if [tuple(t.shape) for t in tensors] != [tuple(t.shape) for t in self.items()]:
            raise CacheLayoutError("replacement tensors do not match the context's items")
        it = iter(tensors)
        kv, e = [], {}
        for block in self.kv:
            kv.append(KVBlock(block.layer, next(it), next(it)))
            if block.layer in self.e:
                e[block.layer] = next(it)
        e |= {l: next(it) for l in sorted(self._loose_e())}
        return dataclasses.replace(self, kv=tuple(kv), e=e)

    def _loose_e(self) -> set[int]:
        """E layers with no KV block of their own (none from a capture; kept, never dropped)."""
        return set(self.e) - {b.layer for b in self.kv}


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_kv(
    block: KVBlock, layer: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Raise `CacheLayoutError` unless `block` is layer `layer`'s KV of `shape` and `dtype` on `device`."""
    if block.layer != layer:
        raise CacheLayoutError(f"expected KV of layer {layer}, got layer {block.layer}")
    for name, t in (("K", block.k), ("V", block.v)):
        check_tensor(f"layer {layer} {name}", t, shape, dtype, device)


def check_tensor(what: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Raise `CacheLayoutError` unless `t` has `shape` and `dtype` and lives on `device` (a
    delivered tensor is used as is: the engine never copies it across devices), and
    `IntegrityError` unless its values are in range (`check_values`)."""
    if tuple(t.shape) != tuple(shape):
        raise CacheLayoutError(f"{what}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != dtype:
        raise CacheLayoutError(f"{what}: dtype {t.dtype}, expected {dtype}")
    if not same_device(t.device, device):
        raise CacheLayoutError(f"{what}: device {t.device}, expected {device}")
    check_values(what, t)


# Largest |value| accepted in a K, V or E tensor of a float dtype: min(MAX_ABS, finfo(dtype).max).
# Real models' keys, values and hidden states stay orders of magnitude below 2**20 (even the
# "massive activations" of large LLMs are ~1e4), so anything beyond it is garbage that a valid
# checksum cannot vouch for; for float16 the dtype's own maximum (65504) is the tighter bound, so
# there the rule is "finite". A NaN or an inf fails it too: the comparison below is False for NaN.
MAX_ABS = float(2**20)


def value_bound(dtype: torch.dtype) -> float:
    return min(MAX_ABS, torch.finfo(dtype).max) if dtype.is_floating_point else float("inf")


def check_values(what: str, t: torch.Tensor) -> None:
    """Raise `IntegrityError` if `t` holds a NaN, an inf or a value beyond `value_bound`. One fused
    reduction (min and max, both NaN-propagating; the CPU's inf-norm is ~20x slower) and one
    device-to-host read per tensor."""
    if not t.dtype.is_floating_point or t.numel() == 0 or t.device.type == "meta":  # meta: shapes only, no values
        return
    lo, hi = torch.aminmax(t)
    peak = float(torch.stack([lo.neg(), hi]).amax())  # max |x|: NaN if any NaN, inf if any inf
    if not peak <= value_bound(t.dtype):
        raise IntegrityError(f"{what}: values out of range (max |x| = {peak}, bound {value_bound(t.dtype):g})")


def reusable_prefix(cached: tuple[int, ...] | list[int], prompt: list[int]) -> int:
    """Tokens of `prompt` that can come from `cached`: the common prefix, but always leave at
    least one prompt token to compute (its logits start decoding)."""
    if not prompt:
        raise BadRequestError("empty prompt")
    return min(common_prefix(cached, prompt), len(prompt) - 1)
