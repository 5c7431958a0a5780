"""The one module that touches transformers' cache internals (transformers 5.x `DynamicCache`).

Everything else sees a cache as an opaque object plus these functions. Layout invariant: per
layer, keys and values are `[B, kv_heads, T, head_dim]`, keys stored *after* RoPE, so a reused
context must occupy the same positions in the receiver as it did in the sender. Every layer,
sliding-window layers included, holds positions 0..T-1 (`new_cache`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from droidmesh.shared.errors import UnsupportedModelError


def new_cache(config: Any, capacity: int | None = None) -> DynamicCache:
    """An empty cache with one (lazily initialised) layer per decoder layer of `config`. With
    `capacity` (tokens: the prompt plus what decoding may append) every attention layer is a
    `WriteOnceLayer` of that capacity, so each token's K/V is written once; without, transformers'
    full layer, which grows by concatenation (a copy of the whole layer per update).

    Sliding-window layers are full layers here too: transformers' `DynamicSlidingWindowLayer`
    keeps only the last W-1 tokens, and then its K/V no longer start at position 0, which every
    reader of a layer (capture, a pull, token-level recompute) assumes. Keeping every token costs
    memory past the window, never exactness: the attention masks each query to its window."""
    cache = DynamicCache(config=config)
    cache.layers = [_full_layer(capacity) if type(entry) in (DynamicLayer, DynamicSlidingWindowLayer) else entry
                    for entry in cache.layers]
    return cache


def _full_layer(capacity: int | None) -> DynamicLayer:
    return DynamicLayer() if capacity is None else WriteOnceLayer(capacity)


class WriteOnceLayer(DynamicLayer):
    """A full-attention layer whose K/V live in storage preallocated for `capacity` tokens
    ([B, kv_heads, capacity, head_dim], allocated at the first update with its dtype and device):
    an update writes its tokens in place after those held, and `keys` / `values` are views of the
    first `length` tokens. Reused KV installed by `set_layer_kv`, the suffix's and every decoded
    token's K/V are each written exactly once; an update past the capacity reallocates (doubling),
    so a wrong estimate costs a copy, never a wrong answer."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k, self._v = (_storage(t, self.capacity) for t in (key_states, value_states))
        self.length = 0
        self._expose()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None  # set by lazy_initialization
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._grow(end)
        self._k[:, :, self.length:end].copy_(key_states)  # [B, kvh, n, hd] into its place
        self._v[:, :, self.length:end].copy_(value_states)
        self.length = end
        self._expose()
        return self._k[:, :, :end], self._v[:, :, :end]  # what `_expose` set as keys / values

    def _grow(self, need: int) -> None:
        assert self._k is not None and self._v is not None
        size = max(need, 2 * self._k.shape[-2])
        k, v = _storage(self._k, size), _storage(self._v, size)
        k[:, :, :self.length].copy_(self._k[:, :, :self.length])
        v[:, :, :self.length].copy_(self._v[:, :, :self.length])
        self._k, self._v = k, v

    def _expose(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]  # [B, kvh, length, hd]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def lend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep K/V in `k` / `v` ([1, kv_heads, capacity, head_dim], storage another owns: a
        decode pool's slot) from now on: what it holds is copied there. Until `reclaim`, the
        owner writes the tokens it decodes straight into that storage and counts them."""
        assert self._k is not None and self._v is not None
        k[:, :, :self.length].copy_(self._k[:, :, :self.length])
        v[:, :, :self.length].copy_(self._v[:, :, :self.length])
        self._k, self._v = k, v
        self._expose()

    def reclaim(self, length: int) -> None:
        """Back into storage of its own (its capacity, or `length` if more), holding `length`
        tokens: those it held at `lend` and those the owner wrote after them."""
        assert self._k is not None and self._v is not None
        size = max(length, self.capacity)
        k, v = _storage(self._k, size), _storage(self._v, size)
        k[:, :, :length].copy_(self._k[:, :, :length])
        v[:, :, :length].copy_(self._v[:, :, :length])
        self._k, self._v, self.length = k, v, length
        self._expose()

    def reset(self) -> None:
        """Empty: the next update starts the layer afresh (`_empty`)."""
        self._k = self._v = None
        self.length = 0
        _empty(self)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last tokens; the next update writes over their places (views taken before
        the crop see that)."""
        super().crop(tokens_to_remove)  # validates the argument; the views it leaves are ours again below
        if self.is_initialized and tokens_to_remove < 0:
            self.length = max(0, self.length + tokens_to_remove)
            self._expose()

    # What would replace `keys` / `values` behind the storage's back is refused, not silently undone
    # by the next update: DroidMesh serves one sequence per cache, on one device.
    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedModelError("a write-once cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedModelError("a write-once cache holds one sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("a write-once cache holds one sequence (no beam search)")

    def offload(self) -> None:
        raise UnsupportedModelError("a write-once cache stays on its device")

    def prefetch(self) -> None:
        raise UnsupportedModelError("a write-once cache stays on its device")


class RaggedKV:
    """One layer's K (or V) of a decode batch: row b is request b's own cache, [1, kv_heads, T_b,
    head_dim], its lengths differing. The engine's attention (`shared/model/attention.py`) reads
    it row by row; no other attention takes it."""

    def __init__(self, rows: list[torch.Tensor]):
        self.rows = rows


class RaggedCache:
    """B requests' own caches, seen by the decoder layers as the cache of one batch [B, 1, D]
    during one decode step: `update` writes row b's new token into cache b (each cache keeps one
    sequence, written once) and hands the attention every row's whole K/V, unpadded. Nothing is
    copied to line the rows up: a padded batch would copy every cache at every step."""

    def __init__(self, caches: list[DynamicCache]):
        self.caches = caches

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[RaggedKV, RaggedKV]:
        """key_states / value_states [B, kv_heads, 1, head_dim] -> each row's K / V after it."""
        ks, vs = [], []
        for b, cache in enumerate(self.caches):
            k, v = cache.update(key_states[b:b + 1], value_states[b:b + 1], layer_idx)  # each [1, kvh, T_b + 1, hd]
            ks.append(k)
            vs.append(v)
        return RaggedKV(ks), RaggedKV(vs)


class SlotsStep:
    """The decode pool's slots (`shared/kv/pool.py`), seen by the decoder layers as the cache
    of one batch [B, 1, D] during one step: row b is slot b; `update` writes its new token's K/V
    at `positions[b]` of slot b (one indexed write per layer, no per-row call) and hands the
    attention the first B slots' first `keys` tokens, [B, kv_heads, keys, head_dim] views, which
    the step's mask limits to each row's own tokens. Every size is fixed by (B, keys), and the
    positions are read from a tensor: nothing here depends on values, so a step can be replayed."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], rows: torch.Tensor, positions: torch.Tensor,
                 keys: int):
        self.k, self.v, self.rows, self.positions, self.keys = k, v, rows, positions, keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states / value_states [B, kv_heads, 1, head_dim] -> the rows' slots [B, kvh, keys, hd]."""
        k, v, b = self.k[layer_idx], self.v[layer_idx], self.rows.shape[0]
        k[self.rows, :, self.positions] = key_states[:, :, 0]  # [B, kvh, hd] at (slot b, token positions[b])
        v[self.rows, :, self.positions] = value_states[:, :, 0]
        return k[:b, :, :self.keys], v[:b, :, :self.keys]


def lendable(cache: Any) -> bool:
    """Whether every layer of `cache` is a write-once layer holding K/V (what a pool can lend)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(e) is WriteOnceLayer and e.is_initialized for e in layers)


def lend(cache: DynamicCache, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
    """Every layer l of `cache` (`lendable`) keeps its K/V in k[l] / v[l] [1, kvh, capacity, hd] from now on."""
    for l, entry in enumerate(cache.layers):
        assert isinstance(entry, WriteOnceLayer)
        entry.lend(k[l], v[l])


def reclaim(cache: DynamicCache, length: int) -> None:
    """Every layer of a lent `cache` back in its own storage, holding `length` tokens."""
    for entry in cache.layers:
        assert isinstance(entry, WriteOnceLayer)
        entry.reclaim(length)


def _storage(like: torch.Tensor, tokens: int) -> torch.Tensor:
    """Uninitialised storage shaped like `like` [B, kvh, *, hd] with `tokens` on the token axis."""
    b, heads, _, dim = like.shape
    return torch.empty(b, heads, tokens, dim, dtype=like.dtype, device=like.device)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s (K, V), each [B, kv_heads, T, head_dim]; raises KeyError if never filled."""
    entry = _entry(cache, layer)
    if not entry.is_initialized or entry.keys is None or entry.values is None or entry.keys.numel() == 0:
        raise KeyError(layer)
    return entry.keys, entry.values


def set_layer_kv(cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Install (K, V) [B, kv_heads, T, head_dim] as layer `layer`'s whole content.

    `update` on an empty layer copies them (into a write-once layer's storage, or concatenated
    onto an empty tensor): the caller's tensors (e.g. a transport's receive buffer) stay
    untouched and may be reused.
    """
    entry = _entry(cache, layer)
    if entry.is_initialized:
        entry.reset() if isinstance(entry, WriteOnceLayer) else _empty(entry)
    cache.update(k, v, layer)


def _empty(entry: DynamicLayer) -> None:
    """A full layer emptied, so that its next `update` initialises it again with what it is given.

    Not transformers' `reset`, whose meaning changed within 5.x: in 5.17 (the GPU machine's) a
    full layer inherits the mixin's, which zeroes K/V in place and leaves the layer initialised,
    so the next update would append after zeros (a write-once layer's would find no storage);
    later releases drop the tensors instead, which is what this does on every version."""
    entry.keys = entry.values = None
    entry.is_initialized = False


def fork(cache: DynamicCache, config: Any, capacity: int) -> DynamicCache:
    """A new cache of `capacity` tokens holding a copy of every layer of `cache` (the prompt's K/V,
    shared by the samples of one request): each sample then appends its own tokens."""
    out = new_cache(config, capacity)
    for l, entry in enumerate(cache.layers):
        keys, values = getattr(entry, "keys", None), getattr(entry, "values", None)
        if isinstance(entry, DynamicLayer) and entry.is_initialized and keys is not None and values is not None \
                and keys.numel():
            set_layer_kv(out, l, keys, values)  # copied into the new layer's own storage
    return out


def seq_length(cache: DynamicCache, layer: int = 0) -> int:
    """Tokens held by `layer` (0 when empty)."""
    return _entry(cache, layer).get_seq_length()


def layer_kwargs(layer: torch.nn.Module, cache: DynamicCache | RaggedCache | SlotsStep) -> dict[str, Any]:
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
