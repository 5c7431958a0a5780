"""Partial prefill against the receiver's own full prefill (float32, ATOL = 1e-4)."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from tests.conftest import ATOL, reference_greedy, reference_logits

L = 6
EVERY_GROUP = [(s, e) for s in range(L) for e in range(s + 1, L + 1)]


def _suffix_diff(result, ref, question) -> float:
    return float((result.logits[-len(question):] - ref[-len(question):]).abs().max())


def test_full_prefill_matches_hf_forward(receiver, prompt):
    """The engine's own layer loop equals the model's HF forward on the whole prompt."""
    ctx, q = prompt
    res = prefill(receiver, ctx + q, ReusePlan.full_prefill(), logits_for=len(ctx) + len(q))
    assert float((res.logits - reference_logits(receiver, ctx + q)).abs().max()) <= ATOL


@pytest.mark.parametrize("plan", [ReusePlan.full_prefill(), ReusePlan.recompute(2, 4)], ids=lambda p: p.label())
def test_logits_are_computed_for_the_positions_asked_only(receiver, prompt, plan):
    """By default only the last prompt token's logits (serving needs the next token, and at 32K
    tokens x 128K vocabulary all of them are 16.8 GB); they equal that row of the full forward.
    More rows when asked, never more than were computed."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    ref = reference_logits(receiver, ctx + q)
    one = prefill(receiver, ctx + q, plan, src)
    assert tuple(one.logits.shape) == (1, ref.shape[-1])
    assert float((one.logits[0] - ref[-1]).abs().max()) <= ATOL
    many = prefill(receiver, ctx + q, plan, src, logits_for=10**6)
    computed = len(ctx) + len(q) if plan.mode == "full_prefill" else len(q)
    assert many.logits.shape[0] == computed


def test_group_covering_all_layers_is_full_prefill(receiver, prompt):
    """Recomputing [0, L) from E_0 reproduces full prefill's logits and greedy tokens."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[0]))
    ref = reference_logits(receiver, ctx + q)
    res = prefill(receiver, ctx + q, ReusePlan.recompute(0, L), src, logits_for=len(q))
    assert res.reused_tokens == len(ctx)
    assert _suffix_diff(res, ref, q) <= ATOL
    gen = generate(receiver, ctx + q, ReusePlan.recompute(0, L), src, max_new_tokens=8)
    assert gen.tokens == reference_greedy(receiver, ctx + q, 8)


@pytest.mark.parametrize("plan", [ReusePlan.recompute(s, e) for s, e in EVERY_GROUP], ids=str)
def test_self_reuse_every_group_is_exact(receiver, prompt, plan):
    """With sender == receiver every recompute group gives the receiver's own output."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=plan.e_layers))
    assert _suffix_diff(prefill(receiver, ctx + q, plan, src, logits_for=len(q)), reference_logits(receiver, ctx + q), q) <= ATOL


@pytest.mark.parametrize(
    "plan",
    [ReusePlan.full_reuse(), ReusePlan.cacheblend(0.0), ReusePlan.cacheblend(0.25), ReusePlan.recompute_groups([(0, 1), (3, 5)]),
     ReusePlan.swap([2]), ReusePlan.swap([0, 3, 5])],
    ids=lambda p: p.label(),
)
def test_self_reuse_baselines_are_exact(receiver, prompt, plan):
    """With sender == receiver full reuse, CacheBlend, scattered groups and the swap probe are exact too."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=plan.e_layers))
    ref = reference_logits(receiver, ctx + q)
    assert _suffix_diff(prefill(receiver, ctx + q, plan, src, logits_for=len(q)), ref, q) <= ATOL
    gen = generate(receiver, ctx + q, plan, src, max_new_tokens=6)
    assert gen.tokens == reference_greedy(receiver, ctx + q, 6)


def test_cacheblend_full_ratio_recovers_a_different_sender(receiver, prompt):
    """CacheBlend with every token recomputed equals full prefill even from a foreign sender."""
    from tests.conftest import perturbed_copy

    ctx, q = prompt
    sender = perturbed_copy(receiver, range(L))
    src = CapturedSource(capture_prefill(sender, ctx))
    ref = reference_logits(receiver, ctx + q)
    assert _suffix_diff(prefill(receiver, ctx + q, ReusePlan.cacheblend(1.0), src, logits_for=len(q)), ref, q) <= ATOL
    assert _suffix_diff(prefill(receiver, ctx + q, ReusePlan.cacheblend(0.0), src, logits_for=len(q)), ref, q) > 10 * ATOL


def test_cached_context_is_a_prefix_of_the_prompt(receiver, prompt):
    """A cache of a longer or diverging context reuses only the common token prefix."""
    ctx, q = prompt
    ref = reference_logits(receiver, ctx + q)
    # The sender cached the context plus other tokens: only len(ctx) tokens are shared.
    other = ctx + [(t + 1) % 97 for t in q] + [5, 6, 7]
    src = CapturedSource(capture_prefill(receiver, other, e_layers=[2]))
    res = prefill(receiver, ctx + q, ReusePlan.recompute(2, 4), src, logits_for=len(q))
    assert res.reused_tokens == len(ctx)
    assert _suffix_diff(res, ref, q) <= ATOL
    # The sender cached exactly the whole prompt: one token is still computed for its logits.
    src = CapturedSource(capture_prefill(receiver, ctx + q))
    res = prefill(receiver, ctx + q, ReusePlan.full_reuse(), src, logits_for=len(q))
    assert res.reused_tokens == len(ctx + q) - 1
    assert float((res.logits[-1] - ref[-1]).abs().max()) <= ATOL


@pytest.mark.parametrize("plan", [ReusePlan.full_prefill(), ReusePlan.recompute(2, 4)], ids=lambda p: p.label())
def test_a_generation_is_freed_by_reference_counting_alone(receiver, prompt, plan):
    """No reference cycles in a generation (cache, logits, stages): dropped with the garbage
    collector off, nothing is left for it to collect, so device memory returns at once."""
    import gc

    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    gc.collect()
    gc.disable()
    try:
        g = generate(receiver, ctx + q, plan, src, max_new_tokens=3)
        del g
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("plan", [ReusePlan.full_prefill(), ReusePlan.recompute(2, 4), ReusePlan.full_reuse()],
                         ids=lambda p: p.label())
def test_every_layer_is_written_once_into_storage_sized_for_prompt_and_decode(receiver, prompt, plan):
    """Reused KV, the suffix and each decoded token land in one preallocated storage per layer
    (no concatenation copy: the storage never moves), sized prompt + decoded tokens exactly."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    res = prefill(receiver, ctx + q, plan, src, decode_tokens=3)
    cache = res.cache
    storages = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
    capacity = (len(ctx) + len(q) + 3) * layer_row_bytes(cache)
    assert all(layer.keys.untyped_storage().nbytes() == capacity for layer in cache.layers)
    past = len(ctx) + len(q)
    with torch.inference_mode():
        for token in (5, 6, 7):
            receiver.run_layers(receiver.embed(receiver.token_tensor([token])), 0, L, cache, past=past)
            past += 1
    assert [layer.keys.untyped_storage().data_ptr() for layer in cache.layers] == storages
    assert all(layer.get_seq_length() == past for layer in cache.layers)


def layer_row_bytes(cache) -> int:
    """Bytes of one token's keys in a layer: kv_heads x head_dim x element size."""
    k = cache.layers[0].keys  # [1, kvh, T, hd]
    return k.shape[1] * k.shape[3] * k.element_size()


def test_write_once_generation_equals_the_reference(receiver, prompt):
    """Decoding on the write-once cache gives the reference's greedy tokens (HF forward, no cache)."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    got = generate(receiver, ctx + q, ReusePlan.recompute(0, L), src, max_new_tokens=8)
    assert got.tokens == reference_greedy(receiver, ctx + q, 8)
