"""The skeleton every networked `BulkClient` shares (ucx, nixl, shm): one cached connection per
sender address, one pull at a time on it, the error contract of a pull, warm-up and close.

A channel subclasses `ChannelClient[C]` (C: what it keeps per address: an endpoint, a stream, a
socket) and supplies four steps; the rest is here, once:
  `_connect(address)`      dial the sender and finish its channel's setup (may raise);
  `_alive(conn)`           whether a cached connection can be reused (the peer has not closed it);
  `_disconnect(address, conn)`  tear one down (after an error, on close, or once found dead);
  `_pull_on(conn, ...)`    one pull over a connection: returns the payload bytes received.
All of it runs on the owning service's event loop; `_shutdown` releases what the client holds
beyond its connections (threads, an agent). What a peer sends is the channel's to check; this
module only guarantees that a connection that failed mid-pull is never reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import torch

from droidmesh.shared.errors import DroidMeshError, TransferError
from droidmesh.shared.transport.bulk import OnItem
from droidmesh.shared.wire.schemas import PullItem, PullRequest, Transport

C = TypeVar("C")


async def guarded_pull(address: str, timeout_s: float, lock: asyncio.Lock, pull: Callable[[], Awaitable[int]],
                       drop: Callable[[], Awaitable[None]]) -> int:
    """The error contract of every networked `BulkClient.pull`: one pull at a time per address
    (`lock`), `timeout_s` over all of it (the wait for the lock included), and on any error `drop`
    the connection before the lock passes on (never reused half-read). DroidMesh errors pass as
    they are; the deadline and anything else become a `TransferError` naming the address."""
    try:
        async with asyncio.timeout(timeout_s):
            async with lock:
                try:
                    return await pull()
                except BaseException:
                    await drop()
                    raise
    except (DroidMeshError, asyncio.CancelledError):
        raise
    except TimeoutError:
        raise TransferError(f"pull from {address} exceeded {timeout_s:.3g}s") from None
    except Exception as e:
        raise TransferError(f"pull from {address} failed: {type(e).__name__}: {e}") from e


class ChannelClient(Generic[C]):
    """Pulls over cached connections (one per sender address, one pull at a time each)."""

    transport: Transport

    def __init__(self) -> None:
        self._conns: dict[str, C] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull `request`'s items into `into`; return the payload bytes received.

        Raises `TransferError` (peer gone, refused, deadline, protocol violation) or
        `IntegrityError` (header, checksum or region mismatch). On any error the connection is
        dropped (which releases what the sender held for it), never reused half-read."""
        landed = False

        def counted(item: PullItem, t: torch.Tensor) -> None:
            nonlocal landed
            landed = True
            on_item(item, t)

        async def pull() -> int:
            reused = address in self._conns
            try:
                return await self._pull_on(await self._connection(address), request, into, counted)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # A cached connection the sender closed as idle just as this pull began fails
                # before anything lands: one fresh connection, under the same deadline. Anything
                # the peer sent wrong (integrity, malformed) is never retried.
                if not reused or landed or (isinstance(e, DroidMeshError) and not isinstance(e, TransferError)):
                    raise
                await self._drop(address)
                return await self._pull_on(await self._connection(address), request, into, counted)

        # The per-address lock is waited for under the pull's own deadline (`guarded_pull`): pulls
        # queued behind a stalled one fail at their own deadline, not one timeout after another.
        return await guarded_pull(address, timeout_s, self._lock(address), pull, lambda: self._drop(address))

    async def warm(self, address: str) -> None:
        """Connect ahead of the first pull (its setup then costs the pull nothing)."""
        async with self._lock(address):
            await self._connection(address)

    async def close(self) -> None:
        for address in list(self._conns):
            await self._drop(address)
        await self._shutdown()

    def _lock(self, address: str) -> asyncio.Lock:
        return self._locks.setdefault(address, asyncio.Lock())

    async def _connection(self, address: str) -> C:
        """The cached connection, or a new one (a dead cached one is torn down first: the sender
        closed an idle connection, or died)."""
        conn = self._conns.get(address)
        if conn is not None and self._alive(conn):
            return conn
        await self._drop(address)
        conn = await self._connect(address)
        self._conns[address] = conn
        return conn

    async def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            await self._disconnect(address, conn)

    # -- a channel's steps ----------------------------------------------------------------------
    async def _connect(self, address: str) -> C:
        raise NotImplementedError

    def _alive(self, conn: C) -> bool:
        raise NotImplementedError

    async def _disconnect(self, address: str, conn: C) -> None:
        raise NotImplementedError

    async def _pull_on(self, conn: C, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem) -> int:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Release what the client holds beyond its connections (nothing, unless overridden)."""
