"""The one module that touches transformers' cache internals (transformers 5.x `DynamicCache`).

Everything else sees a cache as an opaque object plus these functions. Layout invariant: per
layer, keys and values are `[B, kv_heads, T, head_dim]`, keys stored *after* RoPE, so a reused
context must occupy the same positions in the receiver as it did in the sender.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def new_cache(config: Any) -> DynamicCache:
    """An empty cache with one (lazily initialised) layer per decoder layer of `config`."""
    return DynamicCache(config=config)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s (K, V), each [B, kv_heads, T, head_dim]; raises KeyError if never filled."""
    entry = cache.layers[layer]
    if not entry.is_initialized or entry.keys is None or entry.keys.numel() == 0:
        raise KeyError(layer)
    return entry.keys, entry.values


def has_layer(cache: DynamicCache, layer: int) -> bool:
    entry = cache.layers[layer]
    return bool(entry.is_initialized and entry.keys is not None and entry.keys.numel() > 0)


def set_layer_kv(cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Install (K, V) [B, kv_heads, T, head_dim] as layer `layer`'s whole content.

    `update` on an empty layer concatenates onto an empty tensor, i.e. it copies: the caller's
    tensors (e.g. a transport's receive buffer) stay untouched and may be reused.
    """
    entry = cache.layers[layer]
    if entry.is_initialized:
        entry.reset()
    cache.update(k, v, layer)


def seq_length(cache: DynamicCache, layer: int = 0) -> int:
    """Tokens held by `layer` (0 when empty)."""
    return cache.layers[layer].get_seq_length()


def num_layers(cache: DynamicCache) -> int:
    return len(cache.layers)
