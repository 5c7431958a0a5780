"""The receiver's reuse pipeline: pull a holder's tensors while the engine already computes.

`reuse_generate` starts one pull (`shared/transport/pull.py`: transition-layer E first, then the
reused KV layers in layer order) and, concurrently, drives the engine's steps: each step runs on
the torch worker thread, and where the engine needs a layer that has not landed yet the driver
waits for it on the event loop, not on the torch thread. So recompute begins the moment E lands,
and while this request waits for a slow sender other requests' compute uses the thread. A pull
failure is reported into the source, which makes the engine's next read raise
`MissingLayerError`; an engine failure cancels the pull. Either way the caller gets a
`ReuseError` and falls back. Everything here is bounded by `timeout_s`, waiting for a pull slot
included (stalled pulls hold slots only until their own timeout, and full-prefill requests take
none), and by the request's `deadline`: a step still queued for the torch thread when it passes is
dropped (`DeadlineExceededError`), and decoding stops there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from droidmesh.shared.errors import TransferError
from droidmesh.shared.kv.partial import Generation, generate_steps
from droidmesh.shared.kv.policy import Decision
from droidmesh.shared.model.fingerprint import require_compatible
from droidmesh.shared.model.sampling import Sampler
from droidmesh.shared.transport.pull import drive_engine, pull_into, pull_items, request_grant, source_for
from droidmesh.shared.wire import schemas

if TYPE_CHECKING:
    from droidmesh.services.receiver.state import ReceiverState


@dataclasses.dataclass
class ReuseOutcome:
    generation: Generation
    bytes_pulled: int
    stamps: dict[str, float]  # absolute time.perf_counter() per stage
    busy_s: float  # how long the engine held the torch thread (its waits for layers left it free)


async def reuse_generate(
    s: ReceiverState, holder: schemas.CacheAvailable, decision: Decision, prompt: list[int], max_new_tokens: int,
    timeout_s: float, *, sampler: Sampler | None = None, on_token: Callable[[int], bool] | None = None,
    deadline: float | None = None,
) -> ReuseOutcome:
    """`sampler` and `on_token` go to the engine's decoding as they are (see `generate_steps`);
    `deadline` (time.monotonic()) is the request's."""
    model, plan = s.model, decision.plan
    source = source_for(holder, prompt)  # only the prefix this prompt reuses is pulled
    require_compatible(source.fingerprint, model.fingerprint)
    items = pull_items(plan, model.num_layers)
    stamps: dict[str, float] = {}

    until = time.monotonic() + timeout_s

    async def pull() -> int:
        try:
            async with asyncio.timeout(timeout_s):
                await s.pull_slots.acquire()
        except TimeoutError as e:
            err = TransferError(f"no pull slot free within {timeout_s:.3g}s ({s.cfg.max_concurrent_pulls} pulls in flight)")
            source.fail(err)
            raise err from e
        stamps["pull_start"] = time.perf_counter()
        try:
            token = await request_grant(s.bus.request, holder, max(0.01, until - time.monotonic()))  # part of the pull
            stamps["grant_done"] = time.perf_counter()
            return await pull_into(s.bulk, holder, items, model, source, max(0.01, until - time.monotonic()),
                                   token=token, codec=decision.codec, codec_params=decision.codec_params)
        except BaseException as e:
            source.fail(e)
            raise
        finally:
            s.pull_slots.release()
            stamps["pull_done"] = time.perf_counter()

    steps = generate_steps(model, prompt, plan, source, max_new_tokens=max_new_tokens, eos_token_id=s.eos_token_id,
                           timeout_s=timeout_s, sampler=sampler, on_token=on_token, deadline=deadline)
    pull_task = asyncio.get_running_loop().create_task(pull())
    try:
        busy: list[float] = []
        gen = await drive_engine(steps, source, functools.partial(s.run_torch, deadline=deadline), stamps, busy)
    except BaseException:
        pull_task.cancel()
        await asyncio.gather(pull_task, return_exceptions=True)
        raise
    pulled = await pull_task  # done: the engine consumed every layer it asked for
    for key, at in source.arrived_at.items():
        stamps[f"arrived_{key}"] = at
    for stage, rel in gen.prefill.stages.items():
        stamps[stage] = stamps["engine_start"] + rel
    stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
    return ReuseOutcome(gen, pulled, stamps, sum(busy))

