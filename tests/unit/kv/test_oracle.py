"""Training-free oracle: a sender that differs from the receiver only in layers [a, b)."""

from __future__ import annotations

import pytest

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from tests.conftest import ATOL, perturbed_copy, reference_logits

L = 6


@pytest.mark.parametrize("a,b", [(0, 1), (2, 4), (4, 6)])
def test_group_is_exact_iff_it_starts_by_a_and_ends_at_L(receiver, prompt, a, b):
    """Recomputing [s, e) is exact iff s <= a and e == L; every other group is measurably off."""
    ctx, q = prompt
    sender = perturbed_copy(receiver, range(a, b))
    src = CapturedSource(capture_prefill(sender, ctx, e_layers=range(L)))
    ref = reference_logits(receiver, ctx + q)[-len(q):]
    for s in range(L):
        for e in range(s + 1, L + 1):
            diff = float((prefill(receiver, ctx + q, ReusePlan.recompute(s, e), src, logits_for=len(q)).logits[-len(q):] - ref).abs().max())
            if s <= a and e == L:
                assert diff <= ATOL, f"[{s},{e}) should be exact for a sender differing in [{a},{b}): {diff}"
            else:
                assert diff > 100 * ATOL, f"[{s},{e}) should differ for a sender differing in [{a},{b}): {diff}"


def test_group_from_layer_zero_uses_the_receivers_own_embeddings(receiver, prompt):
    """A sender with other token embeddings (a fine-tune that moved them) still gives an exact
    [0, L) recompute: layer 0's input is the receiver's own embedding, nothing is pulled."""
    import copy

    import torch

    from droidmesh.shared.model.adapter import ModelAdapter

    ctx, q = prompt
    sender = ModelAdapter(model=copy.deepcopy(receiver.model), tokenizer=None, name="sender")
    with torch.no_grad():
        sender.model.model.embed_tokens.weight.add_(0.1)
    assert ReusePlan.recompute(0, L).e_layers == ()
    src = CapturedSource(capture_prefill(sender, ctx))  # no E captured at all
    ref = reference_logits(receiver, ctx + q)[-len(q):]
    got = prefill(receiver, ctx + q, ReusePlan.recompute(0, L), src, logits_for=len(q)).logits[-len(q):]
    assert float((got - ref).abs().max()) <= ATOL


@pytest.mark.parametrize("a,b", [(0, 1), (2, 4)])
def test_swap_probe_is_exact_iff_the_swapped_layer_is_below_a(receiver, prompt, a, b):
    """The sensitivity probe (receiver's own prefill, one layer's KV swapped for the sender's)
    needs no E and is exact iff that layer lies below the sender's first changed layer."""
    ctx, q = prompt
    sender = perturbed_copy(receiver, range(a, b))
    src = CapturedSource(capture_prefill(sender, ctx, e_layers=[]))  # no E at all: the probe must not ask
    ref = reference_logits(receiver, ctx + q)[-len(q):]
    for layer in range(L):
        res = prefill(receiver, ctx + q, ReusePlan.swap([layer]), src, logits_for=len(q))
        diff = float((res.logits[-len(q):] - ref).abs().max())
        if layer < a:
            assert diff <= ATOL, f"swapping layer {layer} should be exact for a sender differing in [{a},{b}): {diff}"
        else:
            assert diff > 100 * ATOL, f"swapping layer {layer} should differ for a sender differing in [{a},{b}): {diff}"
