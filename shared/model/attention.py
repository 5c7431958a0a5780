"""The engine's attention: PyTorch's fused SDPA over the cache's own K/V heads.

transformers' `sdpa` path, given the explicit mask a suffix over a cached prefix needs, expands
K/V to every query head (`repeat_kv`: a copy of the whole cache per layer, per call) and passes
the materialized [T, past+T] mask, which keeps SDPA off its fused kernels. Here the causal
pattern follows from the lengths alone: T new queries over past+T keys see keys up to their own
position (lower-right causal; `torch.nn.attention.bias.causal_lower_right`), one new query sees
every key, and GQA runs in the kernel (`enable_gqa`).

A sliding-window layer (the module passes `sliding_window` W; Gemma 3's local layers, Mistral)
also follows from the lengths: the query at position p sees keys p-W+1..p, as transformers'
`sliding_window_overlay` defines it. Keys before every query's window are not read at all, so
one new token reads exactly its W keys with no mask; several read a [T, T+W-1] window mask.
The cache holds every position (the engine keeps full K/V for sliding layers), so key column j
is position j. transformers builds no mask for a registered kernel, so its own forward through
this kernel is masked the same way.

A decode batch (`ModelAdapter.decode`) hands each row's own cache as a `RaggedKV`: one new token
per row, attended row by row over that row's keys, so rows of any lengths batch without padding.
A decode pool's step (`ModelAdapter.decode_slots`) hands the slots' padded K/V with a boolean
mask [B, 1, 1, S] of each row's own keys: one call per layer for the whole batch.

Anything with an explicit mask (token-level recompute, transformers' sdpa / eager callers) goes
to transformers' own sdpa path unchanged. `register()` (idempotent) makes the name loadable;
`load_model` uses it by default.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.model.hf_cache import RaggedKV

NAME = "droidmesh_sdpa"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | RaggedKV, value: torch.Tensor | RaggedKV,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, hd], key / value [B, kvH, past+T, hd] -> ([B, T, H, hd], None).

    Key / value may be a decode batch's `RaggedKV` (T = 1, row b: [1, kvH, past_b + 1, hd]): each
    row is attended on its own, as a batch of one."""
    if isinstance(key, RaggedKV) and isinstance(value, RaggedKV):
        if attention_mask is not None or dropout or query.shape[2] != 1:
            raise UnsupportedModelError("a decode batch attends one new token per row, with no explicit mask")
        rows = [attention(module, query[b:b + 1], k, v, None, scaling=scaling, **kwargs)[0]  # each [1, 1, H, hd]
                for b, (k, v) in enumerate(zip(key.rows, value.rows, strict=True))]
        return torch.cat(rows), None  # [B, 1, H, hd]
    if isinstance(key, RaggedKV) or isinstance(value, RaggedKV):
        raise UnsupportedModelError("keys and values of a decode batch come together")
    if attention_mask is not None and attention_mask.dtype == torch.bool and query.shape[2] == 1 and not dropout:
        # One query per row over the keys its boolean mask [B, 1, 1, S] picks (a decode pool's
        # step: its own slot's tokens, within its window). The query heads sharing a KV head are
        # that head's queries, so K/V are never expanded and the fused kernels that take a mask
        # (but not GQA) apply.
        if query.device.type == "cpu" and query.dtype in _REDUCED:
            out = one_token(query, key, value, scaling, attention_mask)
        else:
            b, h, _, hd = query.shape
            q = query.reshape(b, key.shape[1], h // key.shape[1], hd)  # [B, H, 1, hd] -> [B, kvH, g, hd]
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
            out = out.reshape(b, h, 1, hd)  # [B, kvH, g, hd] -> [B, H, 1, hd]
        return out.transpose(1, 2).contiguous(), None  # [B, H, 1, hd] -> [B, 1, H, hd]
    if attention_mask is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    t, total = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    window: int | None = kwargs.get("sliding_window") or None
    mask: torch.Tensor | None = None
    windowed = window is not None and total > window  # some key lies outside some query's window
    if window is not None and windowed:
        start = max(0, total - t - window + 1)  # the first query's window starts here: earlier keys are never read
        key, value = key[:, :, start:], value[:, :, start:]  # [B, kvH, total - start, hd] views
        if t > 1:  # one query sees exactly the `window` keys left; more need the band
            positions = torch.arange(start, total, device=query.device)  # [total - start]
            mask = visible(positions[-t:], positions, window)  # [T, total - start]
    if t == 1 and query.device.type == "cpu" and query.dtype in _REDUCED:  # one new token sees every key left
        out = one_token(query, key, value, scaling)
    elif windowed or t == 1:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    elif t == total:  # no past: plain causal
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:  # T queries at positions past.. over past+T keys
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(t, total), scale=scaling,
                                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, H, T, hd] -> [B, T, H, hd]


_REDUCED = (torch.bfloat16, torch.float16)


def one_token(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per row over every key given (with `mask` [B, 1, 1, S]: those it marks True),
    as two small matmuls and a float32 softmax: query [B, H, 1, hd], key / value [B, kvH, S, hd] ->
    [B, H, 1, hd].

    For a CPU decode step in bfloat16 or float16: PyTorch's fused CPU kernel spends most of its
    time on per-block overhead when there is a single query (here about 9x longer over 1K keys
    than this), and a decode step is mostly attention once a few rows share it. The query heads
    that share a KV head are the rows of one matmul against it, so K/V are read once and never
    expanded. The scores and softmax stay float32; the probabilities meet V in V's dtype."""
    b, h, _, hd = query.shape
    kvh, keys = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else hd ** -0.5
    q = query.reshape(b * kvh, h // kvh, hd)  # [B, H, 1, hd] -> [B*kvH, g, hd]: query head i reads KV head i // g
    k = key.reshape(b * kvh, keys, hd)  # [B, kvH, S, hd] -> [B*kvH, S, hd] (a view of a cache's slice)
    v = value.reshape(b * kvh, keys, hd)
    scores = torch.bmm(k, q.transpose(1, 2))  # [B*kvH, S, g]: keys-major reads K as stored
    scores = scores.transpose(1, 2).float().mul_(scale)  # [B*kvH, g, S], float32
    if mask is not None:
        hidden = ~mask.expand(b, kvh, 1, keys).reshape(b * kvh, 1, keys)  # [B, 1, 1, S] -> [B*kvH, 1, S]
        scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B*kvH, g, S]
    return torch.bmm(probs, v).reshape(b, h, 1, hd)  # [B*kvH, g, hd] -> [B, H, 1, hd]


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which key each query attends to: q_positions [T], k_positions [S] -> bool [T, S], True where
    the key is at or before the query and, with a sliding `window` W, fewer than W positions back."""
    q, k = q_positions[:, None], k_positions[None, :]  # [T, 1], [1, S]
    seen = k <= q  # [T, S]
    return seen & (k > q - window) if window is not None else seen


def register() -> None:
    AttentionInterface.register(NAME, attention)
