"""A decoder layer in three pieces: what comes before its attention, the attention, what comes after.

A layer's own forward (transformers' `*DecoderLayer`) is one Python call that launches about 50
kernels, of which only the attention reads the cache, whose length changes with every request.
Split at the attention, the two other pieces depend on the number of new tokens alone, so each
can be captured once per token bucket and replayed (`shared/model/graphs.py`, CUDA graphs for a
short pass over a cached prefix), while the attention stays an eager call over the request's own
cache. The pieces do exactly what the layer's forward does, in the same order, with the layer's
own modules (projections, norms, MLP):

  before(h) -> q [1, H, T, hd], k, v [1, kvH, T, hd]   input norm, q/k/v projections, the q/k
                                                       norms (Qwen3, Gemma 3), RoPE
  attend(q, k, v) -> o [1, T, H * hd]                  the cache's update and the engine's attention
  after(o, h) -> h'                                    o projection, residual, the MLP block (Gemma 3:
                                                       its post-attention and feed-forward norms)

`layer_forward` composes them: it equals the layer's own forward, which a test holds it to.
"""

from __future__ import annotations

from typing import Any

import torch

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.model import attention

SANDWICH = ("gemma3_text",)  # families whose attention and MLP outputs are normed before the residual


def check(model_type: str, layer: Any) -> None:
    """Refuse a layer whose modules are not the ones the pieces call."""
    attn = layer.self_attn
    needed = ["input_layernorm", "mlp", "post_attention_layernorm"]
    if model_type in SANDWICH:
        needed += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    missing = [n for n in needed if not hasattr(layer, n)] + [n for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                                                               if not hasattr(attn, n)]
    if missing:
        raise UnsupportedModelError(f"{type(layer).__name__} has no {', '.join(missing)}: it cannot run in pieces")


def before(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [1, T, D], cos / sin [1, T, hd] -> q [1, H, T, hd], k / v [1, kvH, T, hd] (q and k rotated)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    shape = (*h.shape[:-1], -1, attn.head_dim)  # [1, T, heads, hd]
    q = attn.q_proj(x).view(shape).transpose(1, 2)  # [1, T, H * hd] -> [1, H, T, hd]
    k = attn.k_proj(x).view(shape).transpose(1, 2)  # [1, kvH, T, hd]
    v = attn.v_proj(x).view(shape).transpose(1, 2)  # [1, kvH, T, hd]
    if getattr(attn, "q_norm", None) is not None:  # per head vector: the same before or after the transpose
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, hd]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def attend(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any,
           window: int | None) -> torch.Tensor:
    """The new tokens' K/V appended to `cache`'s layer, and their attention over all of it:
    q [1, H, T, hd], k / v [1, kvH, T, hd] -> o [1, T, H * hd]."""
    attn = layer.self_attn
    keys, values = cache.update(k, v, attn.layer_idx)  # each [1, kvH, past + T, hd]
    out, _ = attention.attention(attn, q, keys, values, None, scaling=attn.scaling, sliding_window=window)
    return out.reshape(*out.shape[:2], -1)  # [1, T, H, hd] -> [1, T, H * hd]


def after(layer: Any, model_type: str, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """o [1, T, H * hd] (the attention's output), h [1, T, D] (the layer's input) -> its output [1, T, D]."""
    o = layer.self_attn.o_proj(o)
    if model_type in SANDWICH:
        h = h + layer.post_attention_layernorm(o)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    h = h + o
    return h + layer.mlp(layer.post_attention_layernorm(h))


def layer_forward(layer: Any, model_type: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: Any, window: int | None) -> torch.Tensor:
    """The three pieces in order: the layer's own forward over the engine's attention."""
    q, k, v = before(layer, h, cos, sin)
    return after(layer, model_type, attend(layer, q, k, v, cache, window), h)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

