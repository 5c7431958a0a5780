"""Continuous batching of decode steps on a service's torch thread (`DecodeBatcher`).

A request's prefill runs as its own jobs on the torch thread (a full prefill one layer per job, so
it yields the thread between layers; a reuse as its layers land). Once its first token is chosen,
its `Decoding` joins the batcher (`decode`), which runs one decode step of every joined request
as one job (`shared/kv/decode.step`: one forward, the weights read once), then queues the next.
A request joins at the next step after its prefill and leaves at the step it finishes in.

The rule between prefill and decode: while requests decode, a full prefill queues its next layer
only after a decode step has run since its last (`turn`), and the batcher queues its next step
only after the last one ran; so between two decode steps the thread runs at most one prefill job
per request in its prefill (a layer of a full prefill, or a reuse's run of landed layers). A long
prefill costs each decoding request at most one layer's compute per step, never the whole
prefill; a prefill waits at most one step per layer.

The batch is at most `max_batch` requests (the rest wait in arrival order); memory is bounded
before this: each request's cache was sized for its prompt and answer when its prefill began,
and the receiver holds at most `max_queued_requests` requests. With a decode pool the batch
decodes in its slots (`shared/kv/pool.py`; fixed memory, allocated once; on a GPU each
step a replayed CUDA graph); a request that does not fit a slot decodes beside it. A request's own fault (its
sampler, its stream) ends only it (`Decoding.error`); a caller that is cancelled leaves at the
next step; a failing step fails only the requests in it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from droidmesh.shared.service.engine import RunTorch

if TYPE_CHECKING:
    from droidmesh.shared.kv.decode import Decoding

log = structlog.get_logger("batching")

DEFAULT_MAX_BATCH = 16  # the receiver's `max_batch` default; a sender's own answers batch up to it


class DecodeBatcher:
    """Decodes requests of one model together, on the torch thread `run_torch` serves."""

    def __init__(self, model: Any, run_torch: RunTorch, max_batch: int,
                 on_step: Callable[[int], None] | None = None, pool: Any = None):
        """`on_step(rows)` after every step (metrics), on the loop. `pool`: a decode pool of the
        model's (`shared/kv/pool.KVPool`, `max_batch` slots) its steps run in; None: ragged."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self._torch, self.max_batch, self._on_step = model, run_torch, max_batch, on_step
        self.pool = pool
        self._waiting: collections.deque[tuple[Decoding, asyncio.Future[None]]] = collections.deque()
        self._running: list[tuple[Decoding, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.steps = 0  # decode steps run
        self.rows = 0  # request-steps run (rows / steps: the mean batch)
        self.step_s = 0.0  # EWMA of a step's seconds on the thread (what a prefill job waits behind)
        self._stepped = asyncio.Event()  # set when the step under way ends (a fresh one per step)

    async def turn(self) -> None:
        """Return once the decode step under way (or the next) has run; at once when nothing
        decodes. A prefill awaits this between its jobs, so its jobs and the steps alternate."""
        if self.active:
            await self._stepped.wait()

    def prefill_delay(self, layers: int) -> float:
        """Seconds a full prefill of `layers` layers starting now is expected to wait behind the
        decode steps interleaved with its layers (0 while nothing decodes)."""
        return layers * self.step_s if self.active else 0.0

    @property
    def active(self) -> int:
        """Requests decoding now or waiting for a place in the batch."""
        return len(self._running) + len(self._waiting)

    async def decode(self, d: Decoding) -> None:
        """Decode `d` to its end together with whatever else decodes; return when it has ended.
        Cancelling the caller makes `d` leave at the next step."""
        if d.done:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((d, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="decode-batcher")
        try:
            await fut
        except asyncio.CancelledError:
            d.cancel()
            raise

    async def _run(self) -> None:
        from droidmesh.shared.kv import decode  # here: settings import this module without torch

        try:
            while self._running or self._waiting:
                while self._waiting and len(self._running) < self.max_batch:
                    self._running.append(self._waiting.popleft())
                rows = [d for d, _ in self._running]
                took = 0.0
                try:
                    took = await self._torch(decode.step, self.model, rows, self.pool)
                except Exception as e:  # the forward itself failed: the requests in it fail, no others
                    log.warning("decode_step_failed", rows=len(rows), error=f"{type(e).__name__}: {e}")
                    for d in rows:
                        if not d.done:
                            d.error, d.finish = e, "stop"
                self.step_s = took if self.steps == 0 else 0.8 * self.step_s + 0.2 * took
                self.steps += 1
                self.rows += len(rows)
                self._stepped.set()  # the prefills waiting for a turn go on
                self._stepped = asyncio.Event()
                await asyncio.sleep(0)  # their woken tasks queue their next jobs before the next step
                if self._on_step is not None:
                    self._on_step(len(rows))
                still = []
                for d, fut in self._running:
                    if not d.done:
                        still.append((d, fut))
                    elif not fut.done():
                        fut.set_result(None)
                self._running = still
        finally:  # stopped (the service is going): nobody is left waiting
            self._stepped.set()
            for d, fut in (*self._running, *self._waiting):
                d.cancel()
                if not fut.done():
                    fut.cancel()
            self._running, self._waiting = [], collections.deque()
