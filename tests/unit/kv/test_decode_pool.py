"""The decode pool (`shared/kv/pool.py`): requests decoding in its fixed slots, eagerly or by
replaying a captured step per (batch, keys) bucket, choose exactly the tokens they choose alone.

The same five requests as `test_decode_batch.py` (mixed plans, lengths, limits and a seeded
sampler; Llama, Qwen2 and Gemma 3 with windows narrower than the prompts), float32 on one thread;
the reference is each request decoded alone by the engine. The GPU's capture is stood in for by
`eager_capture`, which runs a capture's warm-up steps for real and replays into one fixed output
from the pool's buffers: what must hold for a CUDA graph (no value read from the host, fixed
shapes per bucket, warm-ups that disturb no held slot) is what these tests check on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.kv import decode
from droidmesh.shared.kv.decode import Decoding
from droidmesh.shared.kv.partial import Generation
from droidmesh.shared.kv.pool import KVPool
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.model.graphs import bucket, buckets, eager_capture
from tests.conftest import FAMILIES
from tests.numeric import assert_close_computed
from tests.unit.kv.test_decode_batch import _finish, _jobs, _solo, _start, spy
from tests.unit.model.test_gemma3 import tiny_gemma3

CAPTURES = {"eager": None, "replayed": eager_capture}


@pytest.fixture(params=["llama", "qwen2", "gemma3_text"], scope="module")
def model(request: pytest.FixtureRequest) -> ModelAdapter:
    if request.param == "gemma3_text":
        return tiny_gemma3(seed=0)  # window 8: every prompt here is longer
    return random_model(request.param, seed=0, name="receiver", **FAMILIES[request.param])


def _pooled(model: ModelAdapter, jobs: list[dict], pool: KVPool, between=None) -> list[Generation]:
    """Every job prefilled, then decoded together in `pool` (`between(step_no, rows)` after each step)."""
    started = [_start(model, job) for job in jobs]
    rows = [d for _, d in started if d is not None]
    n = 0
    while any(not d.done for d in rows):
        decode.step(model, rows, pool)
        n += 1
        if between is not None:
            between(n, rows)
    return [steps if d is None else _finish(steps) for steps, d in started]  # type: ignore[misc]


@pytest.mark.parametrize("capture", CAPTURES)
def test_pooled_decode_equals_each_request_alone(model, capture):
    """Mixed plans, lengths and limits decoding in the pool get each request's solo tokens and
    finish reasons; several rows shared its steps, and every slot is free at the end."""
    jobs = _jobs(model)
    pool = KVPool(model, 8, 96, CAPTURES[capture])
    widths: list[int] = []
    together = _pooled(model, jobs, pool, between=lambda n, rows: widths.append(sum(not d.done for d in rows)))
    for job, gen in zip(jobs, together, strict=True):
        alone = _solo(model, job)
        assert gen.tokens == alone.tokens and gen.finish_reason == alone.finish_reason
    assert max(widths) >= 2 and pool.held == [None] * 8
    assert (capture == "replayed") == bool(pool.graphs)


def test_pooled_logits_match_solo_logits(model):
    """Each row's logits from a pooled step (one masked attention call per layer over padded
    slots) are its solo logits within `tests/numeric.py`'s tolerance."""
    jobs = [j for j in _jobs(model) if "sampler" not in j][:3]
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(jobs))}
    alone: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(jobs))}

    _pooled(model, [dict(job, sampler=lambda i=i: spy(seen, i)) for i, job in enumerate(jobs)],
            KVPool(model, 4, 96, eager_capture))
    for i, job in enumerate(jobs):
        _solo(model, dict(job, sampler=lambda i=i: spy(alone, i)))
        assert len(seen[i]) == len(alone[i]) == job["max_new_tokens"]
        for step, (a, b) in enumerate(zip(seen[i], alone[i], strict=True)):
            assert_close_computed(a, b, dtype=model.dtype, layers=model.num_layers, what=f"row {i}, step {step}")


def test_a_request_cancelled_mid_pool_leaves_the_others_unchanged(model):
    """Cancelling one row after two steps ends it there and frees its slot at the next step;
    every other row's tokens equal its solo run."""
    jobs = _jobs(model)
    pool = KVPool(model, 8, 96, eager_capture)
    freed: list[bool] = []

    def cancel_second(n: int, rows: list[Decoding]) -> None:
        if n == 2:
            rows[1].cancel()
        if n == 3:
            freed.append(not any(d is rows[1] for d in pool.held))

    together = _pooled(model, jobs, pool, between=cancel_second)
    alone = [_solo(model, job) for job in jobs]
    assert together[1].tokens == alone[1].tokens[:3] and together[1].finish_reason == "length"
    assert freed == [True]
    for i in (0, 2, 3, 4):
        assert together[i].tokens == alone[i].tokens


def test_capturing_while_requests_hold_slots_changes_none_of_their_tokens(model):
    """Capturing every bucket mid-decode (a capture's warm-up steps run for real over every slot
    of the bucket, held ones included) writes only at scratch positions: the tokens stay solo's."""
    jobs = _jobs(model)
    pool = KVPool(model, 8, 96, eager_capture)

    def warm_after_two(n: int, rows: list[Decoding]) -> None:
        if n == 2:
            assert any(d is not None for d in pool.held)
            assert pool.warm() == len(buckets(8)) * len(buckets(96, 256))

    together = _pooled(model, jobs, pool, between=warm_after_two)
    for job, gen in zip(jobs, together, strict=True):
        assert gen.tokens == _solo(model, job).tokens


def test_requests_that_do_not_fit_decode_beside_the_pool(model):
    """A request whose answer would pass a slot's scratch position, and requests beyond the slots,
    decode on the ragged path in the same steps, with their solo tokens; the pool never held them."""
    jobs = _jobs(model)
    longest = max(len(j["prompt"]) + j["max_new_tokens"] for j in jobs)
    pool = KVPool(model, 2, longest - 1)  # the longest request no longer fits; two slots for five
    ever: set[int] = set()
    seen: list[Decoding] = []

    def watch(n: int, rows: list[Decoding]) -> None:
        ever.update(id(d) for d in pool.held if d is not None)
        seen[:] = rows

    together = _pooled(model, jobs, pool, between=watch)
    assert len(ever) >= 2 and id(seen[2]) not in ever  # job 2: 57 prompt tokens + 6 new
    for job, gen in zip(jobs, together, strict=True):
        assert gen.tokens == _solo(model, job).tokens


def test_a_finished_request_gets_its_whole_cache_back(model):
    """Once a pooled request ends, its cache is its own again (not a view of a slot, which the
    next request overwrites) and holds its prompt and every token fed: the cache a solo run keeps."""
    job = next(j for j in _jobs(model) if j["max_new_tokens"] > 5 and "sampler" not in j)
    pool = KVPool(model, 1, 96)
    steps, d = _start(model, job)
    assert d is not None
    while not d.done:
        decode.step(model, [d], pool)
    _finish(steps)
    solo_steps, solo = _start(model, job)
    assert solo is not None
    while not solo.done:
        decode.step(model, [solo])
    assert d.tokens == solo.tokens and d.past == solo.past == len(job["prompt"]) + len(d.tokens) - 1
    for l in range(model.num_layers):
        k, v = hf_cache.layer_kv(d.cache, l)
        k0, v0 = hf_cache.layer_kv(solo.cache, l)
        assert k.shape == k0.shape and k.untyped_storage().data_ptr() != pool.k[l].untyped_storage().data_ptr()
        for got, want, kind in ((k, k0, "K"), (v, v0, "V")):
            assert_close_computed(got, want, dtype=model.dtype, layers=model.num_layers, what=f"layer {l} {kind}")
    assert pool.held == [None]


def test_a_failing_pooled_step_frees_its_slots_and_hands_the_caches_back(model, monkeypatch):
    """A forward that raises fails its step (the batcher fails those requests) and leaves no slot
    held: each cache is its own again, with the tokens it held before the step."""
    jobs = [j for j in _jobs(model) if j["max_new_tokens"] > 5][:2]
    pool = KVPool(model, 4, 96)
    rows = [d for _, d in (_start(model, job) for job in jobs) if d is not None]
    decode.step(model, rows, pool)
    pasts = [d.past for d in rows]

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    monkeypatch.setattr(model, "decode_slots", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        decode.step(model, rows, pool)
    assert pool.held == [None] * 4 and [d.past for d in rows] == pasts
    for d in rows:
        k, _ = hf_cache.layer_kv(d.cache, 0)
        assert k.shape[2] == d.past and k.untyped_storage().data_ptr() != pool.k[0].untyped_storage().data_ptr()


def test_buckets_are_powers_of_two_up_to_the_pool():
    assert [bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket(300, 1000, 256) == 512 and bucket(900, 1000, 256) == 1000 and bucket(3, 1000, 256) == 256
    assert buckets(16) == [1, 2, 4, 8, 16] and buckets(600, 256) == [256, 512, 600]


def test_a_pool_too_small_to_hold_a_token_is_refused(model):
    with pytest.raises(Exception, match="decode pool"):
        KVPool(model, 0, 64)
    with pytest.raises(Exception, match="decode pool"):
        KVPool(model, 4, 1)
