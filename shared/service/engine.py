"""Drives one request's engine steps (`shared/kv/sources.Steps`) from the event loop.

The steps (a prefill, a reuse, a generation: `shared/kv/partial.py`) run on the service's torch
thread; where one needs what is not there yet (a layer still in flight, a turn for other
requests' decode steps, its decodings handed to the batcher) the wait happens here, on the loop,
so the compute thread serves other work meanwhile. Used by the receiver's reuse pipeline and own
prefill, the sender's answers and the probe benchmark; a source of arriving layers is anything
`Watched` (`shared/kv/sources.ArrivingSource`, a translated source), whatever channel fills it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from droidmesh.shared.kv.decode import Decoding
from droidmesh.shared.kv.sources import Need, Steps, run_until

T = TypeVar("T")
RunTorch = Callable[..., Awaitable[Any]]  # runs a blocking callable on the torch thread
Decode = Callable[[Decoding], Awaitable[None]]  # decodes a request to its end (a batcher's `decode`)


class Watched(Protocol):
    """A source the driver can ask and be woken by (`ArrivingSource`, `TranslatedSource`)."""

    def has(self, need: Need) -> bool: ...
    def watch(self, fn: Callable[[], None]) -> None: ...


async def drive_engine(steps: Steps[T], source: Watched | None, run_torch: RunTorch, stamps: dict[str, float],
                       busy: list[float] | None = None, decode: Decode | None = None,
                       turn: Callable[[], Awaitable[None]] | None = None) -> T:
    """Run the engine's steps on the torch thread (`run_torch`), waiting for each `Need` here, on
    the loop; `stamps["engine_start"]` is when the first step began on that thread, and `busy`
    gets the seconds each run of steps held it (not the waits for layers in between).

    At a "turn" the thread goes back to whatever queued meanwhile (other requests' decode steps),
    and with `turn` the steps wait for it (a batcher's next step) before going on. With `decode`,
    the request's decodings are handed to it (a batcher that decodes them with other requests)
    and the steps resume once they ended; without, the steps decode them in their last run.
    `source` None: steps that read nothing (a full prefill)."""
    loop = asyncio.get_running_loop()
    landed = asyncio.Event()

    def on_landed() -> None:  # from the producer's thread
        loop.call_soon_threadsafe(landed.set)

    def ready(need: Need) -> bool:  # on the torch thread: go on without a trip to the loop
        if need.kind == "decode":
            return decode is None
        return need.kind != "turn" and (source is None or source.has(need))

    if source is not None:
        source.watch(on_landed)
    after_decode: Any = None  # (finished, value) of the steps run on the loop after a decode
    while True:
        finished, value = after_decode if after_decode is not None else await run_torch(_advance, steps, ready,
                                                                                         stamps, busy)
        after_decode = None
        if finished:
            return value  # the final step's value is the steps' result
        need: Need = value
        if need.kind == "decode" and decode is not None:
            await asyncio.gather(*(decode(d) for d in need.decodings))
            # What is left only assembles the answer (no torch work): here, not queued behind a
            # job that a deadline passed during decoding would drop.
            after_decode = _advance(steps, ready, stamps, busy)
            continue
        if need.kind == "turn" and turn is not None:
            await turn()
        if need.kind == "turn" or source is None:
            continue
        while not source.has(need):
            left = need.deadline - time.monotonic()
            if left <= 0:
                break  # the engine's read raises MissingLayerError
            landed.clear()
            if source.has(need):
                break
            try:
                await asyncio.wait_for(landed.wait(), left)
            except TimeoutError:
                break


def _advance(steps: Steps[T], ready: Callable[[Need], bool], stamps: dict[str, float], busy: list[float] | None
             ) -> tuple[bool, object]:
    """On the torch thread: run steps until one needs what is not `ready` (a layer that has not
    landed, a turn, a decoding to hand over), (False, Need), or to the end, (True, result).
    Landed layers cost no round trip to the loop."""
    began = time.perf_counter()
    stamps.setdefault("engine_start", began)  # in the worker: queueing is not compute
    try:
        return run_until(steps, ready)
    finally:
        if busy is not None:
            busy.append(time.perf_counter() - began)
