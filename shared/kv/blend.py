"""Cross-model CacheBlend-style baseline: token-level instead of layer-level recompute.

CacheBlend (single model) recomputes the few tokens whose KV deviates most and reuses the rest.
Across models: the receiver computes layer 0 for the whole context (one layer: cheap), ranks
tokens by the deviation of its layer-0 K/V from the sender's, and carries the top `ratio` share
through every layer; at layer l those tokens attend to the sender's layer-l KV with their own
positions overwritten by their fresh K/V. Everything else reuses the sender's KV.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from droidmesh.shared.kv.blocks import check_kv
from droidmesh.shared.kv.sources import LayerSource, Need, Steps
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.adapter import ModelAdapter


def blend_steps(
    receiver: ModelAdapter, context: list[int], source: LayerSource, ratio: float, cache: Any, deadline: float
) -> Steps[torch.Tensor]:
    """Fill every layer of `cache` with the blended KV of `context`; return the recomputed
    token positions [n]. Yields a `Need` before each read from `source`."""
    m, full = len(context), len(source.token_ids)
    device = receiver.device
    # Layer 0, all tokens, receiver's own weights: exact KV for layer 0 and the ranking signal.
    h = receiver.run_layers(receiver.embed(receiver.token_tensor(context)), 0, 1, cache, past=0)  # [1, m, D]
    k0, v0 = hf_cache.layer_kv(cache, 0)  # [1, kvh, m, hd]
    yield Need("kv", 0, deadline)
    sent = source.kv(0, deadline)
    check_kv(sent, 0, receiver.kv_shape(full), receiver.dtype, device)
    dev = token_deviation(k0, v0, sent.k[:, :, :m], sent.v[:, :, :m])  # [m]
    n = math.ceil(ratio * m)
    picked = torch.sort(torch.topk(dev, n).indices).values  # [n] ascending positions
    h = h[:, picked]  # [1, n, D]
    positions = picked[None]  # [1, n]
    allowed = blend_visibility(picked, m)  # [1, 1, n, m + n]
    for layer in range(1, receiver.num_layers):
        yield Need("kv", layer, deadline)
        block = source.kv(layer, deadline)
        check_kv(block, layer, receiver.kv_shape(full), receiver.dtype, device)
        k, v = block.k[:, :, :m], block.v[:, :, :m]  # [1, kvh, m, hd]
        hf_cache.set_layer_kv(cache, layer, k, v)
        if n:
            h = receiver.run_sparse_layer(h, layer, cache, positions, allowed)
        # The layer appended the n fresh K/V after the m sender ones: scatter them into place.
        keys, values = hf_cache.layer_kv(cache, layer)  # [1, kvh, m + n, hd]
        k, v = k.clone(), v.clone()
        k[:, :, picked], v[:, :, picked] = keys[:, :, m:], values[:, :, m:]
        hf_cache.set_layer_kv(cache, layer, k, v)
    return picked


def token_deviation(k_a: torch.Tensor, v_a: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per token between two layers' K/V [1, kvh, T, hd] -> [T] float32,
    on the inputs' device."""
    dk = (k_a.float() - k_b.float()).pow(2).sum(dim=(0, 1, 3))  # [T]
    dv = (v_a.float() - v_b.float()).pow(2).sum(dim=(0, 1, 3))  # [T]
    return dk + dv


def blend_visibility(picked: torch.Tensor, m: int) -> torch.Tensor:
    """Visibility [1, 1, n, m + n] for recomputed tokens at positions `picked` [n], on `picked`'s
    device (the mask meets the model's tensors there).

    Key columns 0..m-1 are the sender's KV at positions 0..m-1; columns m.. are the fresh KV of
    the picked tokens. Query i (position p_i) sees the sender's key j iff j <= p_i and j was not
    recomputed, and fresh key j' iff p_j' <= p_i: a causal view of the blended context.
    """
    pos = torch.arange(m, device=picked.device)  # [m]
    recomputed = torch.zeros(m, dtype=torch.bool, device=picked.device)  # [m]
    recomputed[picked] = True
    sender_cols = (pos[None, :] <= picked[:, None]) & ~recomputed[None, :]  # [n, m]
    fresh_cols = picked[None, :] <= picked[:, None]  # [n, n]
    return torch.cat([sender_cols, fresh_cols], dim=1)[None, None]  # [1, 1, n, m + n]
