"""The one module that touches transformers' cache internals (transformers 5.x `DynamicCache`).

Everything else sees a cache as an opaque object plus these functions. Layout invariant: per
layer, keys and values are `[B, kv_heads, T, head_dim]`, keys stored *after* RoPE, so a reused
context must occupy the same positions in the receiver as it did in the sender.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from droidmesh.shared.errors import UnsupportedModelError


def new_cache(config: Any) -> DynamicCache:
    """An empty cache with one (lazily initialised) layer per decoder layer of `config`."""
    return DynamicCache(config=config)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s (K, V), each [B, kv_heads, T, head_dim]; raises KeyError if never filled."""
    entry = _entry(cache, layer)
    if not entry.is_initialized or entry.keys is None or entry.values is None or entry.keys.numel() == 0:
        raise KeyError(layer)
    return entry.keys, entry.values


def set_layer_kv(cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Install (K, V) [B, kv_heads, T, head_dim] as layer `layer`'s whole content.

    `update` on an empty layer concatenates onto an empty tensor, i.e. it copies: the caller's
    tensors (e.g. a transport's receive buffer) stay untouched and may be reused.
    """
    entry = _entry(cache, layer)
    if entry.is_initialized:
        entry.reset()
    cache.update(k, v, layer)


def seq_length(cache: DynamicCache, layer: int = 0) -> int:
    """Tokens held by `layer` (0 when empty)."""
    return _entry(cache, layer).get_seq_length()


def layer_kwargs(layer: torch.nn.Module, cache: DynamicCache) -> dict[str, Any]:
    """The keyword that hands `cache` to a decoder layer: `cache` in transformers >= 5.21,
    `past_key_values` before (5.16-5.20 are what vLLM and SGLang pin). A layer that takes neither
    would silently run without the cache, so that is refused."""
    cls = type(layer)
    name = _CACHE_PARAM.get(cls)
    if name is None:
        params = inspect.signature(cls.forward).parameters
        name = next((n for n in ("cache", "past_key_values") if n in params), None)
        if name is None:
            raise UnsupportedModelError(f"{cls.__name__}.forward takes no cache argument")
        _CACHE_PARAM[cls] = name
    return {name: cache, "use_cache": True}


_CACHE_PARAM: dict[type, str] = {}  # decoder layer class -> its cache keyword


def _entry(cache: DynamicCache, layer: int) -> DynamicLayer:
    """Layer `layer` of the cache: a (full or sliding-window) attention layer holding K/V; the
    linear-attention layers of other families hold no K/V to reuse."""
    entry = cache.layers[layer]
    if not isinstance(entry, DynamicLayer):
        raise UnsupportedModelError(f"cache layer {layer} is a {type(entry).__name__}, not an attention layer's K/V")
    return entry
