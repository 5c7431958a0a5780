"""Decoding options of the engine: sampler and on_token, on CPU tiny models, exact."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.sampling import make_sampler
from tests.conftest import ATOL, reference_greedy, reference_logits

CPU = torch.device("cpu")


def test_temperature_zero_sampler_is_the_greedy_path(receiver, prompt):
    """A temperature-0 sampler gives exactly the default greedy tokens (and HF's own greedy)."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[2]))
    plain = generate(receiver, ctx + q, ReusePlan.recompute(2, 4), src, max_new_tokens=8)
    sampled = generate(receiver, ctx + q, ReusePlan.recompute(2, 4), src, max_new_tokens=8,
                       sampler=make_sampler(0.0, seed=1, device=CPU))
    assert sampled.tokens == plain.tokens == reference_greedy(receiver, ctx + q, 8)
    assert sampled.finish_reason == "length"


def test_seeded_sampling_replays_on_both_paths(receiver, prompt):
    """One seed gives one token sequence, through full prefill and through exact self-reuse alike."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(receiver, ctx, e_layers=[0]))

    def run(seed: int, plan: ReusePlan) -> list[int]:
        return generate(receiver, ctx + q, plan, src if plan.mode != "full_prefill" else None, max_new_tokens=12,
                        sampler=make_sampler(1.0, top_p=0.95, seed=seed, device=CPU)).tokens

    first = run(11, ReusePlan.full_prefill())
    assert run(11, ReusePlan.full_prefill()) == first
    assert run(11, ReusePlan.recompute(0, 6)) == first  # sender == receiver: the same logits, the same draws
    assert any(run(seed, ReusePlan.full_prefill()) != first for seed in (12, 13, 14))


def test_on_token_sees_every_token_and_can_stop(receiver, prompt):
    """on_token gets each chosen token in order, first included; returning False ends decoding
    after that token with finish_reason "stop"."""
    ctx, q = prompt
    full = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=8)
    seen: list[int] = []
    gen = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=8,
                   on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert gen.tokens == seen == full.tokens[:3]
    assert gen.finish_reason == "stop"
    first_only = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=8, on_token=lambda t: False)
    assert first_only.tokens == full.tokens[:1] and first_only.finish_reason == "stop"


def test_eos_is_a_stop_and_the_limit_is_length(receiver, prompt):
    """Decoding that reaches EOS finishes with "stop"; one that reaches max_new_tokens with "length"."""
    ctx, q = prompt
    full = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=6)
    assert full.finish_reason == "length" and len(full.tokens) == 6
    eos = full.tokens[2]  # pretend the third token is EOS
    cut = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=6, eos_token_id=eos)
    assert cut.tokens == full.tokens[: full.tokens.index(eos) + 1] and cut.finish_reason == "stop"


def test_bad_max_new_tokens(receiver, prompt):
    """max_new_tokens below 1 is refused before any compute."""
    with pytest.raises(BadRequestError):
        generate(receiver, prompt[0], ReusePlan.full_prefill(), max_new_tokens=0)


def test_a_cooperative_full_prefill_pauses_between_layers_and_decodes_the_same_tokens(receiver, prompt):
    """With turns, full prefill yields a turn before each layer after the first, offers its decoding
    to the driver once (a driver that does not take it gets a turn before each decode step), reads
    nothing, and generates exactly what the plain call does."""
    from droidmesh.shared.kv.partial import generate_steps

    ctx, q = prompt
    steps = generate_steps(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=5, turns=True)
    needs = []
    with torch.inference_mode():
        try:
            while True:
                needs.append(next(steps))
        except StopIteration as done:
            result = done.value
    assert [(n.kind, n.layer) for n in needs] == ([("turn", l) for l in range(1, receiver.num_layers)] + [("decode", -1)]
                                                  + [("turn", -1)] * 4)
    assert result.tokens == generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=5).tokens
    assert result.tokens == reference_greedy(receiver, ctx + q, 5)


def test_logprobs_are_the_models_own_next_token_distribution(receiver, prompt):
    """With logprobs=k each token carries its log-probability and the k likeliest tokens', equal
    (ATOL) to log_softmax of the model's own forward over the prompt and the answer so far, also
    when a temperature picks the token (they are the distribution before temperature)."""
    ctx, q = prompt
    for sampler in (None, make_sampler(1.3, seed=5, device=CPU)):
        gen = generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=6, logprobs=3, sampler=sampler)
        assert gen.logprobs is not None and [t for t, _, _ in gen.logprobs] == gen.tokens
        ref = torch.log_softmax(reference_logits(receiver, ctx + q + gen.tokens[:-1]), dim=-1)  # [T, vocab]
        for i, (token, lp, top) in enumerate(gen.logprobs):
            row = ref[len(ctx + q) - 1 + i]
            assert abs(lp - float(row[token])) < ATOL
            assert [a for a, _ in top] == row.topk(3).indices.tolist()
            assert all(abs(v - float(row[a])) < ATOL for a, v in top)
    assert generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=2).logprobs is None
    assert generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=2, logprobs=0).logprobs[0][2] == []
    with pytest.raises(BadRequestError):
        generate(receiver, ctx + q, ReusePlan.full_prefill(), max_new_tokens=2, logprobs=21)
