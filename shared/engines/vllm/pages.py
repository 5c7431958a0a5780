"""Writing K/V into vLLM's paged cache, layer by layer, through vLLM's own cache-write kernel.

vLLM's CPU attention keeps a layer as [num_blocks, kv_heads, block_size, 2 * head_dim]: K in the
first block_size rows of each (block, head) viewed as [blocks, heads, 2 * block_size, head_dim],
V in the rest; the order inside each half depends on the kernel's ISA (K transposed for "vec",
both tiled for "amx"). So K/V go in through the op vLLM's own attention writes with
(`cpu_attn_reshape_and_cache`), never by indexing: what lands is exactly what vLLM would have
written had it computed those tokens. GPU backends (flash attention's [2, blocks, block_size,
heads, head_dim]) go through `reshape_and_cache_flash` the same way.
"""

from __future__ import annotations

import re

import torch

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """vLLM's attention layer name ("model.layers.12.self_attn.attn") -> 12."""
    m = LAYER_INDEX.search(f".{name}")
    if m is None:
        raise ValueError(f"no layer index in vLLM layer name {name!r}")
    return int(m.group(1))


def slots_of(block_ids: list[int], block_size: int, tokens: int) -> torch.Tensor:
    """The cache slot of each of the first `tokens` tokens of a request holding `block_ids`."""
    if tokens > len(block_ids) * block_size:
        raise ValueError(f"{tokens} tokens do not fit {len(block_ids)} blocks of {block_size}")
    b = torch.tensor(block_ids, dtype=torch.int64)
    return (b[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:tokens]  # [tokens]


def write_layer(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write K/V [1, kv_heads, m, head_dim] at `slots` [m] of one layer's paged `cache`; every
    shape and slot is checked first, so a refusal leaves the cache untouched."""
    blocks, heads, block_size, width = cache.shape
    if k.shape != v.shape or k.shape[0] != 1 or k.shape[1] != heads or 2 * k.shape[3] != width:
        raise ValueError(f"K/V {tuple(k.shape)} do not fit a cache of {heads} heads x {width // 2} dims")
    if k.shape[2] != slots.numel():
        raise ValueError(f"{k.shape[2]} tokens for {slots.numel()} slots")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= blocks * block_size):
        raise ValueError("a slot outside the cache")
    from vllm import _custom_ops as ops  # vLLM's own kernels: only in an engine's process

    kc, vc = cache.view(blocks, heads, 2 * block_size, width // 2).chunk(2, dim=2)
    key = k[0].transpose(0, 1).to(cache.dtype).contiguous()  # [1, H, m, D] -> [m, H, D]
    value = v[0].transpose(0, 1).to(cache.dtype).contiguous()
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots.to(cache.device), isa)


def isa_of(layer: object, cache: torch.Tensor, cache_dtype: str) -> str:
    """The ISA vLLM's attention layer writes its cache with (set on the layer at load time)."""
    isa = getattr(getattr(layer, "impl", None), "isa", None) or getattr(layer, "isa", None)
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2, cache_dtype)
    return str(isa)
