"""The decode batcher on a real torch thread (`shared/service/batching.py`), driven as the
receiver drives requests (`drive_engine`): concurrent requests decode together and get each one's
solo tokens; a caller cancelled mid-batch leaves the others' tokens unchanged; a long full prefill
interleaves with the decoders one layer per step (the stated rule), checked on the order of the
thread's jobs, not on times.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from droidmesh.shared.kv import decode
from droidmesh.shared.kv.partial import generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.service.batching import DecodeBatcher
from droidmesh.shared.service.engine import drive_engine
from tests.conftest import FAMILIES


@pytest.fixture(scope="module")
def model() -> ModelAdapter:
    return random_model("qwen2", seed=0, name="receiver", **FAMILIES["qwen2"])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (33, 18, 41, 27)]


class Thread:
    """One torch worker thread, as a service has, logging each job's kind in run order."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.jobs: list[str] = []

    async def run(self, fn: Any, *args: Any) -> Any:
        def job() -> Any:
            self.jobs.append("step" if fn is decode.step else "prefill")
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.pool, job)


async def _ask(model: ModelAdapter, thread: Thread, batcher: DecodeBatcher | None, prompt: list[int], n: int,
               turns: bool = True, on_token=None):
    steps = generate_steps(model, prompt, ReusePlan.full_prefill(), max_new_tokens=n, turns=turns, on_token=on_token)
    return await drive_engine(steps, None, thread.run, {}, decode=batcher.decode if batcher else None,
                              turn=batcher.turn if batcher else None)


def test_concurrent_requests_decode_together_with_their_solo_tokens(model):
    prompts, limits = _prompts(), [12, 7, 16, 1]
    thread = Thread()
    batcher = DecodeBatcher(model, thread.run, max_batch=8)

    async def main():
        return await asyncio.gather(*(_ask(model, thread, batcher, p, n) for p, n in zip(prompts, limits, strict=True)))

    gens = asyncio.run(main())
    for gen, p, n in zip(gens, prompts, limits, strict=True):
        assert gen.tokens == generate(model, p, ReusePlan.full_prefill(), max_new_tokens=n).tokens
    assert batcher.steps < sum(n - 1 for n in limits)  # shared steps: fewer than one per token
    assert batcher.rows == sum(n - 1 for n in limits)  # every request took exactly its own steps
    assert batcher.active == 0
    assert batcher.step_s > 0 and batcher.prefill_delay(model.num_layers) == 0  # nothing decodes now: no delay


def test_max_batch_one_decodes_one_request_at_a_time(model):
    prompts = _prompts()[:2]
    thread = Thread()
    batcher = DecodeBatcher(model, thread.run, max_batch=1)

    async def main():
        return await asyncio.gather(*(_ask(model, thread, batcher, p, 6) for p in prompts))

    gens = asyncio.run(main())
    assert batcher.steps == batcher.rows == 2 * 5
    for gen, p in zip(gens, prompts, strict=True):
        assert gen.tokens == generate(model, p, ReusePlan.full_prefill(), max_new_tokens=6).tokens


def test_a_cancelled_caller_leaves_the_batch_and_the_others_are_unchanged(model):
    prompts = _prompts()[:3]
    thread = Thread()
    batcher = DecodeBatcher(model, thread.run, max_batch=8)
    seen: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        third_token = asyncio.Event()

        def on_token(t: int) -> bool:
            seen.append(t)
            if len(seen) == 3:
                loop.call_soon_threadsafe(third_token.set)
            return True

        victim = asyncio.create_task(_ask(model, thread, batcher, prompts[0], 40, on_token=on_token))
        others = [asyncio.create_task(_ask(model, thread, batcher, p, 10)) for p in prompts[1:]]
        await third_token.wait()
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await asyncio.gather(*others)

    gens = asyncio.run(main())
    for gen, p in zip(gens, prompts[1:], strict=True):
        assert gen.tokens == generate(model, p, ReusePlan.full_prefill(), max_new_tokens=10).tokens
    assert len(seen) < 40  # the cancelled request stopped decoding
    assert batcher.active == 0


def _jobs_beside_a_decoder(model: ModelAdapter) -> list[str]:
    """The thread's jobs from when one request is decoding until another's full prefill (a
    164-token prompt, a job per layer) has answered; the decoder runs until then (no race on its
    length). "Decoding" means a decode step has run: the first token comes from the decoder's own
    prefill, before it joins the batch, and a prefill that starts in that gap owes no turn to a
    batch with nobody in it (on a busy host the gap is long enough to be hit)."""
    prompts = _prompts()
    thread = Thread()
    batcher = DecodeBatcher(model, thread.run, max_batch=8)
    stop = threading.Event()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        decoding_now = asyncio.Event()

        tokens = 0

        def on_token(t: int) -> bool:
            nonlocal tokens
            tokens += 1
            if tokens == 2:  # the first token a decode step chose: the decoder is in the batch
                loop.call_soon_threadsafe(decoding_now.set)
            return not stop.is_set()

        decoding = asyncio.create_task(_ask(model, thread, batcher, prompts[0], 500, on_token=on_token))
        await decoding_now.wait()
        start = len(thread.jobs)
        await _ask(model, thread, batcher, prompts[2] * 4, 2)
        stop.set()
        await decoding
        return start

    return thread.jobs[asyncio.run(main()):]


def test_a_long_prefill_runs_a_layer_between_decode_steps(model):
    """While requests decode, another's full prefill takes the thread one layer per job, and the
    batcher's steps run between its layers: no decode step waits behind more than one prefill job."""
    during = _jobs_beside_a_decoder(model)
    prefill_jobs = [i for i, kind in enumerate(during) if kind == "prefill"]
    assert len(prefill_jobs) >= model.num_layers  # one job per layer (and one to resume after decoding)
    first, last = prefill_jobs[0], prefill_jobs[model.num_layers - 1]
    window = during[first:last + 1]
    # between two of its layers a decode step ran: the decoders were never stalled by the whole prefill
    assert "prefill,prefill" not in ",".join(window)
    assert window.count("step") >= model.num_layers - 1


def test_prefill_jobs_and_decode_steps_alternate_one_to_one(model):
    """While one request decodes and another prefills, the thread's jobs alternate: a step, a
    layer, a step, a layer (the prefill waits for no more than one step per layer)."""
    during = _jobs_beside_a_decoder(model)
    first = during.index("prefill")
    layers = during[first:first + 2 * model.num_layers - 1]
    assert layers == ["prefill", "step"] * (model.num_layers - 1) + ["prefill"]


def test_the_batcher_refuses_a_batch_of_zero(model):
    with pytest.raises(ValueError):
        DecodeBatcher(model, functools.partial(asyncio.sleep, 0), max_batch=0)


def test_an_answer_cut_by_its_deadline_is_returned_not_dropped(model):
    """Once a request's deadline has passed, the receiver's thread drops its queued jobs; decoding
    stopped there still returns the tokens it has: assembling the answer after the batch is not a
    job the deadline can drop."""
    from droidmesh.shared.errors import DeadlineExceededError

    thread = Thread()
    batcher = DecodeBatcher(model, thread.run, max_batch=8)
    expired = threading.Event()

    async def run(fn: Any, *args: Any) -> Any:  # as ReceiverState.run_torch with a deadline
        if expired.is_set():
            raise DeadlineExceededError("deadline passed while queued for the compute thread; dropped")
        return await thread.run(fn, *args)

    def on_token(t: int) -> bool:  # the deadline passes at the third token; decoding stops there
        seen.append(t)
        if len(seen) == 3:
            expired.set()
        return len(seen) < 3

    seen: list[int] = []
    steps = generate_steps(model, _prompts()[0], ReusePlan.full_prefill(), max_new_tokens=20, on_token=on_token)
    gen = asyncio.run(drive_engine(steps, None, run, {}, decode=batcher.decode))
    assert gen.tokens == seen and len(gen.tokens) == 3
