"""UCX operations on an endpoint with the buffer lifetime UCX needs, and the channel's framing.

A UCX operation writes into (or reads from) its buffer until UCX completes or cancels it, which
cancelling the Python task awaiting it does not do. So every buffer handed to UCX is kept
referenced (`_IN_FLIGHT`) by the task running its operation, never cancelled, until that
operation ends: on an error or a cancelled pull the endpoint is aborted (`abort`), which makes UCX
cancel what it still has posted, and only when those operations report back are the buffers let
go. Freeing a buffer earlier lets a resumed sender's bytes land in freed memory.

Torch-free (a sender's sandbox processes use it). All on the event loop of the process that owns
the endpoint; `abort` may hold that loop for at
most ABORT_NS. A peer's declared frame length is checked before anything is allocated for it.
"""

from __future__ import annotations

import array
import asyncio
from typing import Any

import structlog

from droidmesh.shared.errors import BadMessageError

log = structlog.get_logger("ucx")
ABORT_NS = 200_000_000  # how long an abort may hold the event loop (ucxx's default is 10 s per attempt)
_IN_FLIGHT: set[asyncio.Task] = set()
IDLE_SPIN_S = 0.05  # how long after a request the server waits for the next as tightly as ucxx would
IDLE_PAUSE_S = 0.002  # the longest pause between probes of an idle connection (longer cost link rate)


def op(coro: Any) -> asyncio.Task:
    """Run one UCX operation (its coroutine holds its buffer) as a task nobody cancels: it ends
    when UCX completes or cancels the operation (after an abort), and stays referenced till then."""
    task = asyncio.ensure_future(coro)
    _IN_FLIGHT.add(task)
    task.add_done_callback(_op_done)
    return task


def _op_done(task: asyncio.Task) -> None:
    _IN_FLIGHT.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an aborted operation's error is expected, not worth a warning


def in_flight() -> int:
    """UCX operations still holding a buffer (tests: 0 once every aborted endpoint has reported back)."""
    return len(_IN_FLIGHT)


async def recv(ep: Any, buffer: Any) -> Any:
    """`ep.recv(buffer)`; cancelling the caller leaves the receive (and `buffer`) to `op`."""
    return await asyncio.shield(op(ep.recv(buffer)))


async def send(ep: Any, buffer: Any) -> Any:
    return await asyncio.shield(op(ep.send(buffer)))


async def send_obj(ep: Any, data: bytes) -> None:
    """`ep.send_obj(data)` (length, then bytes), each buffer kept alive as `send` does."""
    await send(ep, array.array("Q", [len(data)]))
    await send(ep, bytearray(data))


async def recv_frame(ep: Any, cap: int) -> bytes:
    """One `send_obj` message (an 8-byte length, then the bytes), its length checked against
    `cap` before a buffer is allocated for it (ucxx's `recv_obj` allocates whatever the peer
    declares). A message longer than a posted buffer fails in UCX, which allocates nothing."""
    size = array.array("Q", [0])
    await recv(ep, size)
    n = size[0]
    if not 0 < n <= cap:
        raise BadMessageError(f"peer declared a {n}-byte message; at most {cap}")
    data = bytearray(n)
    await recv(ep, data)
    return bytes(data)


async def wait_for_message(ep: Any) -> None:
    """Return once a message for `ep` has arrived, or the endpoint closed or failed (the receive
    that follows then raises). An awaited ucxx receive polls its request with `asyncio.sleep(0)`,
    so a receive posted for an idle peer's next request kept the event loop, and a core, busy for
    as long as the connection lived. Here the loop yields as tightly for the first IDLE_SPIN_S
    (a pull's next request usually follows within that), then probes with pauses doubling up to
    IDLE_PAUSE_S: an idle connection costs ~500 wake-ups a second (4–5 % of a core here, against a
    whole core), a request after a pause waits at most that long."""
    from ucxx.types import Tag

    worker, tag = ep._ctx.worker, Tag(ep._tags["msg_recv"])
    loop = asyncio.get_running_loop()
    spin_until, pause = loop.time() + IDLE_SPIN_S, IDLE_PAUSE_S / 16
    while not ep.closed and not worker.tag_probe(tag).matched:
        try:
            ep._ep.raise_on_error()
        except Exception:  # a failed endpoint: the receive reports it
            return
        if loop.time() < spin_until:
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(pause)
            pause = min(IDLE_PAUSE_S, pause * 2)


def abort(ep: Any) -> None:
    """Abort `ep` (UCX cancels what it has posted; those operations then report back and let go of
    their buffers), waiting at most ABORT_NS on the loop; its TCP lifeline closes with it."""
    if ep is not None and getattr(ep, "_ep", None) is not None:
        try:
            ep.abort(period=ABORT_NS)
        except Exception as e:  # an endpoint already torn down by an error: nothing left to abort
            log.debug("ucx_abort_failed", error=repr(e))
    link = getattr(ep, "_droidmesh_link", None)
    if link is not None:
        link.close()  # the peer's lifeline ends with the endpoint
