"""The K/V of a reused context under a plan, for a serving engine that computes the rest itself.

A serving engine that takes a prompt's first m tokens' K/V from outside (vLLM through its KV
connector, `shared/engines/vllm/`) computes the suffix with its own kernels. This builds those
m tokens' K/V of every layer exactly as the partial prefill's steps 1 and 2 read them
(`partial.py`): the plan's recomputed groups (and patch layers) run the receiver's own layers
over the sender's E, and every other layer is the sender's K/V, checked and cut to m tokens.
Nothing of the suffix is computed here, so the result is what `prefill_steps` would hold for the
context before it runs the suffix.

Only plans over whole layers of a full-attention model: a sliding-window layer's K/V arrives as
its window only (`transport/pull.window_starts`), which an engine's paged cache of the whole
prefix cannot take; such a receiver is refused (`check_engine_reusable`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from droidmesh.shared.errors import BadRequestError, ReuseError
from droidmesh.shared.kv.blocks import check_kv, reusable_prefix
from droidmesh.shared.kv.partial import fill_context
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import LayerSource, Need, Steps
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.fingerprint import require_compatible

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [1, kv_heads, m, head_dim]


def check_engine_reusable(receiver: ModelAdapter, plan: ReusePlan) -> None:
    """Raise `ReuseError` when an engine's prefix K/V cannot be built for `plan` on `receiver`."""
    if plan.mode in ("full_prefill", "swap", "cacheblend"):
        raise ReuseError(f"plan {plan.label()} has no reused prefix an engine could take as K/V")
    if any(w is not None for w in receiver.windows):
        raise ReuseError(f"{receiver.name} has sliding-window layers: only their window would arrive")


def context_kv_steps(receiver: ModelAdapter, prompt: Sequence[int], plan: ReusePlan, source: LayerSource,
                     *, timeout_s: float) -> Steps[list[KV]]:
    """The K/V of `prompt`'s reused prefix (m = the source's shared prefix, at most all but the
    prompt's last token) for every layer, in layer order, as steps that yield a `Need` before
    each read from `source` (`sources.run_until` / the engine driver waits for arrivals).

    Each returned tensor is on the receiver's device and dtype, [1, kv_heads, m, head_dim],
    contiguous. Raises `ReuseError` (the caller falls back to its own prefill) when the source
    shares nothing with the prompt, a layer is missing, late or malformed."""
    check_engine_reusable(receiver, plan)
    ids = [int(t) for t in prompt]
    if len(ids) < 2:
        raise BadRequestError("a prompt of one token has no prefix to reuse (its last token is always computed)")
    L = receiver.num_layers
    plan.validate(L)
    require_compatible(source.fingerprint, receiver.fingerprint)
    m = min(reusable_prefix(source.token_ids, ids), len(ids) - 1)
    if m == 0:
        raise ReuseError("the sender's context shares no token prefix with the prompt")
    receiver.check_length(m)
    deadline = time.monotonic() + timeout_s
    cache = receiver.new_cache(m)
    stages: dict[str, float] = {}
    filled = yield from fill_context(receiver, ids[:m], plan, source, cache, deadline, stages, time.perf_counter())
    full = len(source.token_ids)
    out: list[KV] = []
    for layer in range(L):
        if filled[layer]:
            k, v = hf_cache.layer_kv(cache, layer)  # [1, kvh, m, hd], computed here
        else:
            yield Need("kv", layer, deadline)
            block = source.kv(layer, deadline)
            check_kv(block, layer, receiver.kv_shape(full), receiver.dtype, receiver.device)
            k, v = block.k[:, :, :m], block.v[:, :, :m]  # [1, kvh, full, hd] -> [1, kvh, m, hd]
        out.append((k.contiguous(), v.contiguous()))
    return out
