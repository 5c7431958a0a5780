"""The shm server's per-pull copy on a worker thread, and what a cancel waits for."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from droidmesh.shared.transport.shm.server import _off_loop
from tests.unit.transport.cancels import returned_early


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

    assert not asyncio.run(returned_early(_off_loop(make), entered, gate))
    with pytest.raises(OSError):
        os.fstat(made[0])  # closed by the cancelled caller
