"""`ReusePlan` patch layers: what validates, and which layers need the sender's E."""

from __future__ import annotations

import dataclasses

import pytest

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.plan import ReusePlan

L = 6


@pytest.mark.parametrize("plan", [
    ReusePlan.recompute(2, 4).patched([3]),  # inside a recompute group
    ReusePlan.full_reuse().patched([6]),  # past the last layer
    ReusePlan.full_reuse().patched([-1]),
    dataclasses.replace(ReusePlan.full_reuse(), patch=(4, 2)),  # unsorted
    dataclasses.replace(ReusePlan.full_reuse(), patch=(2, 2)),  # twice
    dataclasses.replace(ReusePlan.cacheblend(0.5), patch=(1,)),  # a mode that takes none
    dataclasses.replace(ReusePlan.full_prefill(), patch=(1,)),
])
def test_bad_patch_layers_are_refused(plan):
    """Patch layers overlapping a group, out of range, unsorted, repeated, or in another mode: BadRequestError."""
    with pytest.raises(BadRequestError):
        plan.validate(L)


def test_patch_layers_need_e_and_are_neither_reused_nor_recomputed():
    """A patch layer's E is pulled (layer 0's too), its KV is the receiver's own projection."""
    plan = ReusePlan.recompute(2, 4).patched([0, 5])
    plan.validate(L)
    assert plan.e_layers == (0, 2, 5)
    assert plan.recomputed_layers(L) == (2, 3) and plan.reused_layers(L) == (1, 4)
    assert ReusePlan.full_reuse().patched([4, 3]).patch == (3, 4)
    assert plan.label() == "recompute [2,4) + patch 0,5"
