"""The engine's attention: PyTorch's fused SDPA over the cache's own K/V heads.

transformers' `sdpa` path, given the explicit mask a suffix over a cached prefix needs, expands
K/V to every query head (`repeat_kv`: a copy of the whole cache per layer, per call) and passes
the materialized [T, past+T] mask, which keeps SDPA off its fused kernels. Here the causal
pattern follows from the lengths alone: T new queries over past+T keys see keys up to their own
position (lower-right causal; `torch.nn.attention.bias.causal_lower_right`), one new query sees
every key, and GQA runs in the kernel (`enable_gqa`). Anything else (an explicit mask from
token-level recompute, a sliding window) goes to transformers' own sdpa path unchanged.
`register()` (idempotent) makes the name loadable; `load_model` uses it by default.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "droidmesh_sdpa"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, hd], key / value [B, kvH, past+T, hd] -> ([B, T, H, hd], None)."""
    if attention_mask is not None or kwargs.get("sliding_window") or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    t, total = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if t == 1:  # one new token sees every key
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
    elif t == total:  # no past: plain causal
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:  # T queries at positions past.. over past+T keys
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(t, total), scale=scaling,
                                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, H, T, hd] -> [B, T, H, hd]


def register() -> None:
    AttentionInterface.register(NAME, attention)
