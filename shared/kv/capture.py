"""Capturing prefill: prefill a context, keep every layer's KV and chosen E's.

A sender captures what it is asked to prefill (`capture_prefill`); a receiver keeps what its own
full prefill of a request computed anyway (`captured_of`: the prompt's KV out of the serving cache,
the E the prefill kept), so serving a prompt makes it reusable.

E is 2-4x the size of a layer's KV (hidden vs kv_heads*head_dim*2), so it is captured only for
the layers a receiver's recompute groups start at.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.kv.partial import PrefillResult
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


@torch.inference_mode()
def captured_of(model: ModelAdapter, prompt: Sequence[int], pre: PrefillResult,
                prefix: CapturedContext | None = None) -> CapturedContext:
    """The context `model` computed for `prompt`: every layer's K/V of the prompt's tokens, copied
    out of `pre.cache` (which decoding went on appending to, and which is freed with its request),
    and E where kept. `pre` is a full prefill (then this equals `capture_prefill(model, prompt,
    pre.e)`: the same operations ran), or a full reuse of `prefix`, a context of `model` itself
    (the reused tokens' K/V are `prefix`'s, exact for this model; each kept E is `prefix`'s for
    the reused tokens and the suffix's own after them; a layer `prefix` has no E for is dropped).
    Any other reuse is refused: a recomputed group's KV is not the model's own."""
    t, m = len(prompt), pre.reused_tokens
    if pre.plan.mode == "full_prefill" and prefix is None and m == 0:
        e = dict(pre.e)  # each [1, t, D]: a full prefill keeps E of the prompt's tokens only
    elif pre.plan.mode == "full_reuse" and not pre.plan.patch and prefix is not None:
        if prefix.fingerprint.id != model.fingerprint.id or tuple(prompt[:m]) != prefix.token_ids[:m]:
            raise BadRequestError("the reused context is not this model's cache of the prompt's prefix")
        e = {l: torch.cat([prefix.e[l][:, :m], x], dim=1)  # [1, m, D] + [1, t - m, D] -> [1, t, D]
             for l, x in pre.e.items() if l in prefix.e}
    else:
        raise BadRequestError("only a full prefill, or a full reuse of the model's own cache, is the model's own KV")
    kv = []
    for l in range(model.num_layers):
        k, v = hf_cache.layer_kv(pre.cache, l)  # each [1, kvh, >= t, hd]
        kv.append(KVBlock(l, k[:, :, :t].clone(), v[:, :, :t].clone()))  # [1, kvh, t, hd], contiguous
    return CapturedContext(token_ids=tuple(int(i) for i in prompt), fingerprint=model.fingerprint,
                           model_name=model.name, kv=tuple(kv), e=e)


@torch.inference_mode()
def captured_from_engine(model: ModelAdapter, token_ids: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         e_layers: Iterable[int] = ()) -> CapturedContext:
    """A context another engine prefilled with `model`'s weights: its K/V of every layer as that
    engine computed them (each [1, kv_heads, T, head_dim]), and E at each of `e_layers` computed
    here, since no engine hands its hidden states out: the embedding and layers [0, max E) over the
    tokens (a fraction of a prefill; their K/V go to a scratch cache and are dropped). E is this
    model's, in its dtype: within the tolerance of two kernels of the engine's own E."""
    ids = list(token_ids)
    wanted = sorted(set(e_layers))
    if not ids or len(kv) != model.num_layers:
        raise BadRequestError(f"{len(kv)} layers of K/V over {len(ids)} tokens for a model of {model.num_layers} layers")
    shape = model.kv_shape(len(ids))
    for l, (k, v) in enumerate(kv):
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise BadRequestError(f"layer {l}: K {tuple(k.shape)} V {tuple(v.shape)}, expected {shape}")
    if any(not 0 <= l < model.num_layers for l in wanted):
        raise BadRequestError(f"E layers {wanted} outside 0..{model.num_layers - 1}")
    e: dict[int, torch.Tensor] = {}
    if wanted:
        scratch = model.new_cache(len(ids))
        h = model.embed(model.token_tensor(ids))  # [1, T, D]
        start = 0
        for stop in wanted:
            h = model.run_layers(h, start, stop, scratch, past=0)
            e[stop] = h.clone()
            start = stop
    # the engine's cache may live elsewhere (a GPU engine, weights on the host): the context is the model's
    blocks = tuple(KVBlock(l, k.to(device=model.device, dtype=model.dtype).contiguous(),
                           v.to(device=model.device, dtype=model.dtype).contiguous()) for l, (k, v) in enumerate(kv))
    return CapturedContext(token_ids=tuple(ids), fingerprint=model.fingerprint, model_name=model.name, kv=blocks, e=e)
