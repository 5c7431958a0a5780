"""Continuous batching in the engine (`shared/kv/decode.py`): requests decoding together, each
over its own cache, choose exactly the tokens they choose alone; one that leaves (cancelled, past
its deadline, its own callback failing) changes nothing for the others.

Tiny random models of every family the engine batches (Llama MHA, Qwen2 GQA with bias, Gemma 3
with sliding-window layers narrower than the prompts), float32 on one thread. The reference is
each request decoded alone by the same engine (itself equal to the model's own forward:
`test_generate.py`, `test_partial.py`); tokens must be equal, and the logits a batch computes for
each row within `tests/numeric.py`'s tolerance of that row's solo logits (a batch runs its
products at other shapes than one row alone, which may round differently).
"""

from __future__ import annotations

import time

import pytest
import torch

from droidmesh.shared.kv import decode
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.decode import Decoding
from droidmesh.shared.kv.partial import Generation, generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource, Need, run_until
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.model.sampling import make_sampler
from tests.conftest import FAMILIES, perturbed_copy
from tests.numeric import assert_close_computed
from tests.unit.model.test_gemma3 import tiny_gemma3

CPU = torch.device("cpu")


@pytest.fixture(params=["llama", "qwen2", "gemma3_text"], scope="module")
def model(request: pytest.FixtureRequest) -> ModelAdapter:
    if request.param == "gemma3_text":
        return tiny_gemma3(seed=0)  # window 8: every prompt here is longer
    return random_model(request.param, seed=0, name="receiver", **FAMILIES[request.param])


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 97, (int(length),), generator=g).tolist() for length in (40, 23, 57, 31, 12)[:n]]


def _jobs(model: ModelAdapter) -> list[dict]:
    """Five requests: different lengths, plans (full prefill, partial from a perturbed sender,
    full reuse of its own cache), limits, and a seeded sampler."""
    prompts = _prompts(5)
    sender = perturbed_copy(model, range(2, 4))
    ctx_a, ctx_b = prompts[0][:30], prompts[2][:50]
    return [
        dict(prompt=prompts[0], plan=ReusePlan.recompute(0, 2),
             source=CapturedSource(capture_prefill(sender, ctx_a, e_layers=[0])), max_new_tokens=9),
        dict(prompt=prompts[1], plan=ReusePlan.full_prefill(), source=None, max_new_tokens=14),
        dict(prompt=prompts[2], plan=ReusePlan.full_reuse(),
             source=CapturedSource(capture_prefill(model, ctx_b)), max_new_tokens=6),
        dict(prompt=prompts[3], plan=ReusePlan.full_prefill(), source=None, max_new_tokens=11,
             sampler=lambda: make_sampler(0.9, top_p=0.9, seed=3, device=CPU)),
        dict(prompt=prompts[4], plan=ReusePlan.full_prefill(), source=None, max_new_tokens=1),
    ]


def _kwargs(job: dict, **extra) -> dict:
    kw = dict(max_new_tokens=job["max_new_tokens"], **extra)
    if "sampler" in job:
        kw["sampler"] = job["sampler"]()  # a fresh generator per run: the same seed, the same draws
    return kw


def _start(model: ModelAdapter, job: dict, **extra) -> tuple[object, Decoding | None]:
    """Run a request's steps to its "decode" need: (its steps, its decoding; None if it ended at
    its first token)."""
    steps = generate_steps(model, job["prompt"], job["plan"], job["source"], **_kwargs(job, **extra))
    finished, value = run_until(steps, lambda n: n.kind != "decode")
    if finished:
        return value, None
    assert isinstance(value, Need) and len(value.decodings) == 1
    return steps, value.decodings[0]


def _finish(steps: object) -> Generation:
    finished, gen = run_until(steps, lambda n: True)  # type: ignore[arg-type]
    assert finished
    return gen  # type: ignore[return-value]


def _batched(model: ModelAdapter, jobs: list[dict], between=None, **extra) -> list[Generation | BaseException]:
    """Every job prefilled, then decoded together step by step (`between(step_no, rows)` after each)."""
    started = [_start(model, job, **extra) for job in jobs]
    rows = [d for _, d in started if d is not None]
    n = 0
    while any(not d.done for d in rows):
        decode.step(model, rows)
        n += 1
        if between is not None:
            between(n, rows)
    out: list[Generation | BaseException] = []
    for steps, d in started:
        if d is None:
            out.append(steps)  # type: ignore[arg-type]
            continue
        try:
            out.append(_finish(steps))
        except Exception as e:
            out.append(e)
    return out


def _solo(model: ModelAdapter, job: dict, **extra) -> Generation:
    return generate(model, job["prompt"], job["plan"], job["source"], **_kwargs(job, **extra))


def test_batched_decode_equals_each_request_alone(model):
    """Five requests of mixed plans, lengths and limits decoding together get exactly the tokens
    (and finish reasons) each gets alone; the batch really ran several rows per step."""
    assert model.batches
    jobs = _jobs(model)
    widths: list[int] = []
    together = _batched(model, jobs, between=lambda n, rows: widths.append(sum(not d.done for d in rows)))
    for job, gen in zip(jobs, together, strict=True):
        alone = _solo(model, job)
        assert isinstance(gen, Generation)
        assert gen.tokens == alone.tokens and gen.finish_reason == alone.finish_reason
        assert len(gen.tokens) == job["max_new_tokens"]
    assert max(widths, default=0) >= 3 - 1  # rows leave as they finish; several shared the early steps


def spy(store: dict[int, list[torch.Tensor]], i: int):
    """A greedy sampler that keeps every row of logits it is handed in store[i]."""
    def choose(row: torch.Tensor) -> int:
        store[i].append(row.clone())
        return int(row.argmax())
    return choose


def test_batched_logits_match_solo_logits(model):
    """The logits a batched step computes for each row are that row's solo logits (within the tolerance)."""
    jobs = [j for j in _jobs(model) if "sampler" not in j][:3]
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(jobs))}
    alone: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(jobs))}

    started = [_start(model, dict(job, sampler=lambda i=i: spy(seen, i))) for i, job in enumerate(jobs)]
    rows = [d for _, d in started if d is not None]
    while any(not d.done for d in rows):
        decode.step(model, rows)
    for i, job in enumerate(jobs):
        _solo(model, dict(job, sampler=lambda i=i: spy(alone, i)))
        assert len(seen[i]) == len(alone[i]) == job["max_new_tokens"]
        for step, (a, b) in enumerate(zip(seen[i], alone[i], strict=True)):
            assert_close_computed(a, b, dtype=model.dtype, layers=model.num_layers, what=f"row {i}, step {step}")


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(model):
    """Cancelling one row after two steps ends it there ("length", its tokens so far); every other
    row's tokens equal its solo run."""
    jobs = _jobs(model)

    def cancel_second(n: int, rows: list[Decoding]) -> None:
        if n == 2:
            rows[1].cancel()

    together = _batched(model, jobs, between=cancel_second)
    alone = [_solo(model, job) for job in jobs]
    cancelled = together[1]
    assert isinstance(cancelled, Generation)
    assert cancelled.tokens == alone[1].tokens[:3] and cancelled.finish_reason == "length"
    for i in (0, 2, 3, 4):
        gen = together[i]
        assert isinstance(gen, Generation) and gen.tokens == alone[i].tokens


def test_a_failing_callback_fails_only_its_request(model):
    """A row whose own on_token raises fails with that error; the rows beside it decode on."""
    jobs = _jobs(model)[:3]
    started = []
    for i, job in enumerate(jobs):
        calls = []

        def on_token(t: int, calls=calls, bad=(i == 0)) -> bool:
            calls.append(t)
            if bad and len(calls) == 3:
                raise RuntimeError("the client's stream broke")
            return True

        started.append(_start(model, job, on_token=on_token))
    rows = [d for _, d in started if d is not None]
    while any(not d.done for d in rows):
        decode.step(model, rows)
    with pytest.raises(RuntimeError, match="stream broke"):
        _finish(started[0][0])
    for (steps, _), job in zip(started[1:], jobs[1:], strict=True):
        assert _finish(steps).tokens == _solo(model, job).tokens


def test_a_row_past_its_deadline_leaves_first(model):
    """A row whose deadline has passed ends before the next step with what it has; the others
    are untouched."""
    jobs = _jobs(model)[:2]
    started = [_start(model, job) for job in jobs]
    rows = [d for _, d in started if d is not None]
    decode.step(model, rows)
    rows[0].deadline = time.monotonic() - 1.0
    while any(not d.done for d in rows):
        decode.step(model, rows)
    first, second = (_finish(steps) for steps, _ in started)
    assert len(first.tokens) == 2 and first.finish_reason == "length"
    assert second.tokens == _solo(model, jobs[1]).tokens


def test_a_model_without_the_engine_attention_decodes_rows_alone():
    """transformers' sdpa cannot read a ragged batch: the step runs its rows one by one, same tokens."""
    model = random_model("llama", seed=0, attn_implementation="sdpa", name="receiver", **FAMILIES["llama"])
    assert not model.batches
    jobs = [j for j in _jobs(model) if j["plan"].mode == "full_prefill"]
    for job, gen in zip(jobs, _batched(model, jobs), strict=True):
        assert isinstance(gen, Generation) and gen.tokens == _solo(model, job).tokens


def test_samples_of_one_prompt_share_its_prefill_and_each_decode_as_alone(model):
    """More samples of one request (OpenAI's n) decode together, each over its own copy of the
    prompt's cache: each gets exactly the tokens its own seed gets from a request of its own, and
    its own limit (stop callbacks, EOS) ends it alone."""
    job = _jobs(model)[1]

    def hot(seed: int):
        return make_sampler(1.0, top_p=0.95, seed=seed, device=CPU)

    stops: list[int] = []
    gen = generate(model, job["prompt"], job["plan"], None, max_new_tokens=10, sampler=hot(1),
                   samples=[(hot(2), None), (hot(3), lambda t: stops.append(t) or len(stops) < 4), (hot(1), None)])
    alone = [generate(model, job["prompt"], job["plan"], None, max_new_tokens=10, sampler=hot(s)).tokens for s in (1, 2, 3)]
    assert gen.tokens == alone[0] and len(gen.samples) == 3
    assert gen.samples[0].tokens == alone[1] and gen.samples[0].finish_reason == "length"
    assert gen.samples[1].tokens == alone[2][:4] and gen.samples[1].finish_reason == "stop"
    assert gen.samples[2].tokens == alone[0]  # the same seed: the same draws, from its own cache copy
    assert gen.decode_batch == 4
