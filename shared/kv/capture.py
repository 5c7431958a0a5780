"""Capturing prefill (sender side): prefill a context, keep every layer's KV and chosen E's.

E is 2-4x the size of a layer's KV (hidden vs kv_heads*head_dim*2), so it is captured only for
the layers a receiver's recompute groups start at.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.adapter import ModelAdapter


@torch.inference_mode()
def capture_prefill(sender: ModelAdapter, token_ids: Sequence[int], e_layers: Iterable[int] = ()) -> CapturedContext:
    """Prefill `token_ids` on `sender`; return its per-layer KV and E at each of `e_layers`."""
    ids = list(token_ids)
    if not ids:
        raise BadRequestError("cannot capture an empty context")
    wanted = sorted(set(e_layers))
    bad = [l for l in wanted if not 0 <= l < sender.num_layers]
    if bad:
        raise BadRequestError(f"E layers {bad} outside 0..{sender.num_layers - 1}")
    sender.check_length(len(ids))
    cache = sender.new_cache(len(ids))  # exactly the context: each layer's K/V come out contiguous
    h = sender.embed(sender.token_tensor(ids))  # [1, T, D]
    e: dict[int, torch.Tensor] = {}
    # Walk the layers in segments split at each wanted E so E_l is snapshotted on the way.
    bounds = [l for l in wanted if l > 0] + [sender.num_layers]
    if 0 in wanted:
        e[0] = h.clone()
    start = 0
    for stop in bounds:
        h = sender.run_layers(h, start, stop, cache, past=0)
        if stop < sender.num_layers:
            e[stop] = h.clone()
        start = stop
    kv = tuple(KVBlock(l, *hf_cache.layer_kv(cache, l)) for l in range(sender.num_layers))
    return CapturedContext(
        token_ids=tuple(ids), fingerprint=sender.fingerprint, model_name=sender.name, kv=kv, e=e
    )
