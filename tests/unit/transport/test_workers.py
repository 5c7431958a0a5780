"""`workers.run_settled`: a cancel returns only once the thread is done with what it writes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from droidmesh.shared.transport.workers import run_settled
from tests.unit.transport.cancels import returned_early


def _gated(entered: threading.Event, gate: threading.Event, done: list[str], name: str):
    def job() -> str:
        entered.set()
        gate.wait(10)
        done.append(name)
        return name

    return job


def test_however_many_cancels_come_a_running_job_is_waited_for_and_what_it_made_disposed_of():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    entered, gate, done, abandoned = threading.Event(), threading.Event(), [], []

    job = run_settled(pool, _gated(entered, gate, done, "job"), abandon=abandoned.append)
    try:
        assert not asyncio.run(returned_early(job, entered, gate))
    finally:
        pool.shutdown()
    assert done == ["job"] and abandoned == ["job"]


def test_a_job_cancelled_before_it_began_never_runs_and_is_not_waited_behind_others():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    entered, gate, done = threading.Event(), threading.Event(), []
    busy = pool.submit(_gated(entered, gate, done, "other pull's"))

    async def cancel_queued():
        task = asyncio.ensure_future(run_settled(pool, done.append, "queued"))
        await asyncio.to_thread(entered.wait, 10)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return busy.done()  # the cancel came back while the pool was still busy

    try:
        assert not asyncio.run(cancel_queued())
    finally:
        gate.set()
        pool.shutdown()
    assert done == ["other pull's"]


def test_a_jobs_result_and_error_reach_the_caller():
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def fails() -> None:
        raise ValueError("bad payload")

    try:
        assert asyncio.run(run_settled(pool, sorted, [3, 1, 2])) == [1, 2, 3]
        with pytest.raises(ValueError, match="bad payload"):
            asyncio.run(run_settled(pool, fails))
    finally:
        pool.shutdown()
