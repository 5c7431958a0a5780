"""The shm server's per-pull copy on a worker thread, and what a cancel waits for."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from droidmesh.shared.transport.shm.server import _off_loop


def test_a_copy_cancelled_twice_returns_once_the_copy_is_done_and_closes_what_it_made():
    """The pull's hold is released after `_off_loop` returns: a cancel must not return while the
    copy it charges still runs, nor leave its descriptor open."""
    entered, gate = threading.Event(), threading.Event()
    made: list[int] = []

    def make() -> int:
        entered.set()
        gate.wait(10)
        made.append(os.memfd_create("copy"))
        return made[-1]

    async def cancel_mid_copy():
        task = asyncio.ensure_future(_off_loop(make))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0.01)
        task.cancel()  # a connection's cancel, then the server's close cancelling it again
        await asyncio.sleep(0.05)
        returned_early = task.done()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return returned_early

    assert not asyncio.run(cancel_mid_copy())
    with pytest.raises(OSError):
        os.fstat(made[0])  # closed by the cancelled caller
