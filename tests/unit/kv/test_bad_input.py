"""Bad caches and bad plans raise specific errors naming what differs; nothing half-applied."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from droidmesh.shared.errors import (
    BadRequestError,
    CacheLayoutError,
    IncompatibleModelsError,
    IntegrityError,
    MissingLayerError,
    ReuseError,
)
from droidmesh.shared.kv.blocks import KVBlock
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import random_model
from tests.conftest import FAMILIES


def _with_kv(captured, layer: int, block: KVBlock):
    kv = list(captured.kv)
    kv[layer] = block
    return dataclasses.replace(captured, kv=tuple(kv))


def test_fingerprint_mismatch_names_the_field(receiver, prompt, family):
    """A sender with another layer count is refused, naming num_layers with both values."""
    ctx, q = prompt
    other = random_model(family, seed=3, **dict(FAMILIES[family], num_hidden_layers=4))
    src = CapturedSource(capture_prefill(other, ctx))
    with pytest.raises(IncompatibleModelsError, match=r"num_layers: sender=4 receiver=6") as info:
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), src)
    assert set(info.value.diff) == {"num_layers"}


def test_wrong_shape_is_refused(receiver, prompt):
    """A KV block with a truncated token axis raises CacheLayoutError naming the layer."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx)
    bad = KVBlock(3, cap.kv[3].k[:, :, :-1], cap.kv[3].v[:, :, :-1])
    with pytest.raises(CacheLayoutError, match="layer 3 K: shape"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), CapturedSource(_with_kv(cap, 3, bad)))


def test_wrong_dtype_is_refused(receiver, prompt):
    """A bfloat16 KV block for a float32 receiver raises CacheLayoutError naming the dtype."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx)
    bad = KVBlock(1, cap.kv[1].k.to(torch.bfloat16), cap.kv[1].v.to(torch.bfloat16))
    with pytest.raises(CacheLayoutError, match="dtype torch.bfloat16, expected torch.float32"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), CapturedSource(_with_kv(cap, 1, bad)))


def test_block_for_wrong_layer_is_refused(receiver, prompt):
    """A block labelled with another layer index is refused."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx)
    with pytest.raises(CacheLayoutError, match="expected KV of layer 2, got layer 4"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), CapturedSource(_with_kv(cap, 2, cap.kv[4])))


def test_missing_e_is_refused(receiver, prompt):
    """Recomputing from a layer whose E the sender did not capture raises MissingLayerError."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[1]))
    with pytest.raises(MissingLayerError, match="no E for layer 2"):
        prefill(receiver, ctx + q, ReusePlan.recompute(2, 4), src)


def test_error_leaves_no_partial_state(receiver, prompt):
    """After a refused cache, the same source-free full prefill is unaffected (no shared state)."""
    ctx, q = prompt
    before = prefill(receiver, ctx + q, ReusePlan.full_prefill()).logits
    cap = capture_prefill(receiver, ctx)
    bad = KVBlock(5, cap.kv[5].k[:, :1], cap.kv[5].v[:, :1])
    with pytest.raises(CacheLayoutError):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), CapturedSource(_with_kv(cap, 5, bad)))
    # bitwise: the same prefill on the same prompt, run again
    assert torch.equal(prefill(receiver, ctx + q, ReusePlan.full_prefill()).logits, before)


@pytest.mark.parametrize(
    "plan,match",
    [
        (ReusePlan.recompute(4, 9), "outside"),
        (ReusePlan("groups", groups=((0, 3), (2, 4))), "overlap"),
        (ReusePlan.cacheblend(1.5), "ratio"),
        (ReusePlan("bogus"), "unknown plan mode"),  # type: ignore[arg-type]  # invalid on purpose
    ],
)
def test_bad_plans_are_refused(receiver, prompt, plan, match):
    """Plans that do not fit the model raise BadRequestError before any work."""
    ctx, q = prompt
    with pytest.raises(BadRequestError, match=match):
        prefill(receiver, ctx + q, plan, CapturedSource(capture_prefill(receiver, ctx)))


def test_no_common_prefix_is_a_reuse_error(receiver, prompt):
    """A cache of an unrelated context is a ReuseError (the caller falls back)."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, [(t + 1) % 97 for t in ctx]))
    with pytest.raises(ReuseError, match="no token prefix"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), src)


def test_reuse_plan_without_source_is_a_bad_request(receiver, prompt):
    """Asking for reuse without a sender cache is a BadRequestError."""
    ctx, q = prompt
    with pytest.raises(BadRequestError, match="needs a sender cache"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse())


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), 1e30, -3e9])
@pytest.mark.parametrize("mode", ["kv", "e", "blend"])
def test_poisoned_values_are_integrity_errors(receiver, prompt, poison, mode):
    """A NaN, inf or absurdly large value in a sender's K/V or E is an IntegrityError (a ReuseError: fallback)."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx, e_layers=[2])
    if mode == "e":
        e = cap.e[2].clone()
        e[0, 1, 3] = poison
        cap, plan = dataclasses.replace(cap, e={2: e}), ReusePlan.recompute(2, 4)
    else:
        v = cap.kv[4].v.clone()
        v[0, 0, 2, 1] = poison
        cap = _with_kv(cap, 4, KVBlock(4, cap.kv[4].k, v))
        plan = ReusePlan.cacheblend(0.2) if mode == "blend" else ReusePlan.full_reuse()
    with pytest.raises(IntegrityError, match="values out of range"):
        prefill(receiver, ctx + q, plan, CapturedSource(cap))


def test_values_within_the_bound_are_accepted(receiver, prompt):
    """Large but plausible activations (1e4) pass the range check."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx)
    v = cap.kv[1].v.clone()
    v[0, 0, 0, 0] = 1e4
    prefill(receiver, ctx + q, ReusePlan.full_reuse(), CapturedSource(_with_kv(cap, 1, KVBlock(1, cap.kv[1].k, v))))
