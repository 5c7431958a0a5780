"""Work a channel's event loop hands to a thread: the pools it runs on, and what a cancel of its
caller waits for.

The pools are bounded, each for one kind of work, so the memory and the cores that work takes
beside the engine's thread stay those of a few items however many pulls are in flight:
  `encoders()`  a sender's encodings (`answer.answer_async`);
  `decoders()`  a receiver's decodings of landed items (`bulk.land_async`);
  `copiers()`   a sender's per-pull copies into shared memory (the shm and ucx channels).

A channel's thread work writes memory its caller owns (a receiver's buffers, a sender's per-pull
copy that a pull hold charges). When the caller is cancelled (a pull's deadline, a connection
that ends, a server that closes) that memory is freed, reused or uncharged right after: so a
cancel must not return while the thread still writes it. `run_settled` keeps that promise
through any number of cancels, and a job that has not begun is dropped instead of awaited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ENCODERS = 2  # one long encoding (a big int4 plan) leaves the other for the pulls behind it
DECODERS = 2  # one long decoding (a big int4 item) leaves the other for the pulls beside it
COPIERS = 4  # memcpy-bound: a few connections' copies at once


@functools.cache
def encoders() -> concurrent.futures.ThreadPoolExecutor:
    """Beyond the pull budget, an encoding takes an int4 float32 copy of the item it is on (on a GPU
    sender's device): ENCODERS items' worth."""
    return concurrent.futures.ThreadPoolExecutor(ENCODERS, thread_name_prefix="droidmesh-encode")


@functools.cache
def decoders() -> concurrent.futures.ThreadPoolExecutor:
    """A decoding takes int4's float copy of the item it is on: DECODERS items' worth."""
    return concurrent.futures.ThreadPoolExecutor(DECODERS, thread_name_prefix="droidmesh-decode")


@functools.cache
def copiers() -> concurrent.futures.ThreadPoolExecutor:
    """Each copy is charged to the pull budget before it is made."""
    return concurrent.futures.ThreadPoolExecutor(COPIERS, thread_name_prefix="droidmesh-copy")


async def run_settled(executor: concurrent.futures.Executor, fn: Callable[..., T], *args: object,
                      abandon: Callable[[T], None] | None = None) -> T:
    """`fn(*args)` on `executor`. Cancelled before the job begins, it never runs; cancelled while it
    runs, this re-raises the cancel only once the job is done (later cancels meanwhile are taken
    as the same one), after `abandon` has disposed of what the job made."""
    job = executor.submit(fn, *args)
    try:
        return await asyncio.shield(asyncio.wrap_future(job))
    except asyncio.CancelledError:
        job.cancel()  # fails when the job has begun: it is waited for
        await settled(job)
        if abandon is not None and not job.cancelled() and job.exception() is None:
            abandon(job.result())
        raise


async def settled(job: concurrent.futures.Future) -> None:
    """Return once `job` is done, whatever cancels this meanwhile (the caller re-raises its own);
    its outcome is left to the caller."""
    while not job.done():
        try:
            await asyncio.shield(asyncio.wrap_future(job))
        except (asyncio.CancelledError, Exception):
            pass
