"""The reused context's K/V for an outside engine, against the partial prefill's own cache
(float32, ATOL = 1e-4): what an engine is handed is what our engine would have held."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import ReuseError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.context import context_kv_steps
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource, run_steps
from droidmesh.shared.model import hf_cache
from tests.conftest import ATOL, perturbed_copy


def _context_kv(receiver, ids, plan, src):
    with torch.inference_mode():  # as the engine driver runs it
        return run_steps(context_kv_steps(receiver, ids, plan, src, timeout_s=5.0))


@pytest.mark.parametrize("plan", [ReusePlan.full_reuse(), ReusePlan.recompute(2, 4), ReusePlan.recompute(0, 2),
                                  ReusePlan.recompute_groups([(1, 2), (4, 6)])], ids=lambda p: p.label())
def test_the_context_kv_is_the_partial_prefills_cache_of_the_context(receiver, prompt, plan):
    """Another model's sender: every layer's K/V of the m context tokens equals what the partial
    prefill under the same plan holds for them (the suffix then sees the same cache)."""
    if any(w is not None for w in receiver.windows):
        pytest.skip("sliding-window receivers are refused (next test)")
    ctx, q = prompt
    sender = perturbed_copy(receiver, range(0, receiver.num_layers))
    src = CapturedSource(capture_prefill(sender, ctx, e_layers=plan.e_layers))
    kv = _context_kv(receiver, ctx + q, plan, src)
    ref = prefill(receiver, ctx + q, plan, src).cache
    assert len(kv) == receiver.num_layers
    for layer, (k, v) in enumerate(kv):
        rk, rv = hf_cache.layer_kv(ref, layer)
        assert k.shape == (1, *receiver.kv_shape(len(ctx))[1:]) and k.is_contiguous()
        assert float((k - rk[:, :, :len(ctx)]).abs().max()) <= ATOL, layer
        assert float((v - rv[:, :, :len(ctx)]).abs().max()) <= ATOL, layer
    if plan.mode == "full_reuse":  # nothing recomputed: the sender's own K/V
        assert torch.equal(kv[0][0], src.kv(0, 0.0).k[:, :, :len(ctx)])  # bitwise: a slice of the same bytes


def test_refused_what_an_engine_cannot_take(receiver, prompt):
    """No reused prefix (full prefill, a swap probe, CacheBlend), a sliding-window receiver, a
    source sharing nothing, a one-token prompt: refused before anything is read."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    windowed = any(w is not None for w in receiver.windows)
    for plan in (ReusePlan.full_prefill(), ReusePlan.swap([1]), ReusePlan.cacheblend(0.2)):
        with pytest.raises(ReuseError):
            _context_kv(receiver, ctx + q, plan, src)
    if windowed:
        with pytest.raises(ReuseError, match="sliding-window"):
            _context_kv(receiver, ctx + q, ReusePlan.full_reuse(), src)
        return
    with pytest.raises(ReuseError, match="shares no token prefix"):
        _context_kv(receiver, [ctx[0] + 1, *ctx[1:]], ReusePlan.full_reuse(), src)


def test_a_prompt_equal_to_the_context_leaves_its_last_token_to_the_engine(receiver, prompt):
    """m stops one short of the prompt: the engine computes the last token (its logits)."""
    if any(w is not None for w in receiver.windows):
        pytest.skip("sliding-window receivers are refused")
    ctx, _ = prompt
    src = CapturedSource(capture_prefill(receiver, ctx))
    kv = _context_kv(receiver, ctx, ReusePlan.full_reuse(), src)
    assert kv[0][0].shape[2] == len(ctx) - 1
