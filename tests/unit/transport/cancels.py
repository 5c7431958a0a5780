"""Cancelling a coroutine whose work runs on a thread, as a pull's callers do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable

import pytest


async def returned_early(job: Awaitable, entered: threading.Event, gate: threading.Event) -> bool:
    """Start `job`; once its thread has `entered`, cancel it twice (a pull's deadline, then its
    request's cancel) and say whether it returned while the thread still waited for `gate`; then
    set `gate` and check that the cancel is what `job` ends with."""
    task = asyncio.ensure_future(job)
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.05)
    early = task.done()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    return early
