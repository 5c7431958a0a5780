"""The token sampler: greedy is argmax, seeds replay, top-p narrows, temperature spreads."""

from __future__ import annotations

import math

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model.sampling import check_sampling, greedy, make_sampler

CPU = torch.device("cpu")


def _logits(seed: int = 0, vocab: int = 97) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def test_temperature_zero_is_argmax():
    """temperature 0 returns the engine's greedy choice, whatever top_p and seed say."""
    sampler = make_sampler(0.0, top_p=0.3, seed=5, device=CPU)
    assert sampler is greedy
    for seed in range(20):
        logits = _logits(seed)
        assert sampler(logits) == int(logits.argmax())


def test_same_seed_same_tokens():
    """Two samplers with one seed draw the same sequence; another seed draws another."""
    seq = [_logits(i) for i in range(64)]

    def draws(seed: int) -> list[int]:
        sampler = make_sampler(1.0, top_p=0.9, seed=seed, device=CPU)
        return [sampler(x) for x in seq]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_tiny_top_p_keeps_only_the_top_token():
    """top_p so small that one token reaches it: every draw is the argmax."""
    for seed in range(20):
        logits = _logits(seed)
        assert make_sampler(1.5, top_p=1e-6, seed=seed, device=CPU)(logits) == int(logits.argmax())


def test_temperature_spreads_draws_on_flat_logits():
    """On equal logits a positive temperature picks more than one token over many seeds."""
    flat = torch.zeros(97, dtype=torch.float32)
    picks = {make_sampler(0.7, seed=s, device=CPU)(flat) for s in range(50)}
    assert len(picks) > 1


def test_top_p_never_draws_outside_the_nucleus():
    """With two tokens holding 0.9 of the mass, top_p 0.85 draws only those two."""
    probs = torch.tensor([0.6, 0.3, 0.05, 0.05], dtype=torch.float32)
    logits = probs.log()
    sampler = make_sampler(1.0, top_p=0.85, seed=0, device=CPU)
    assert {sampler(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("temperature,top_p,seed,match", [
    (5.0, 1.0, None, "temperature"), (-0.1, 1.0, None, "temperature"), (math.nan, 1.0, None, "temperature"),
    (1.0, 0.0, None, "top_p"), (1.0, 1.5, None, "top_p"), (1.0, math.nan, None, "top_p"),
    (1.0, 1.0, -1, "seed"), (1.0, 1.0, 2**64, "seed"),
])
def test_out_of_range_values_are_bad_requests(temperature, top_p, seed, match):
    """Each out-of-range value raises BadRequestError naming it."""
    with pytest.raises(BadRequestError, match=match):
        check_sampling(temperature, top_p, seed)
    with pytest.raises(BadRequestError, match=match):
        make_sampler(temperature, top_p, seed, device=CPU)
