"""The sender side of a bulk channel's TCP control stream: one listener bound to the configured host.

Used by the NIXL channel (grants) and the UCX channel (worker-address wireup). Called from a bulk
server's `start` and `close`, on the event loop:
  - `start(host, port)` binds the host's first address only (one socket, so one port even when
    the port is 0: ephemeral) and returns ("host:port" with the configured host, the bound
    (address, port)); it never binds the wildcard address.
  - each accepted connection is admitted to the server's slots first (`slots.py`: per source
    address and in all, an idle connection's slot given to the newcomer when needed), before a
    byte is read; a refused one is closed at once. An admitted one runs `handler(reader, writer,
    slot)` as its own task, which marks its waits and pulls on the slot; `SlotEnded` (its
    deadline passed, or its slot was taken) ends it quietly (counted and logged by the slots).
    The writer is closed when the handler returns (whatever the handler did first stays first).
  - `close()` stops listening, cancels the connections' tasks and waits for them (each ends
    quietly: a cancelled connection task is not an error).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits, Slots

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Slot], Awaitable[None]]


class ControlListener:
    def __init__(self, name: str, handler: Handler, limits: SlotLimits | None = None):
        self._handler = handler
        self.slots = Slots(name, limits)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, tuple[str, int]]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        self._server = await asyncio.start_server(self._serve, str(infos[0][4][0]), port)
        bound = self._server.sockets[0].getsockname()
        return f"{host}:{bound[1]}", (bound[0], bound[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a stream server callback always runs as a task
        peer = writer.get_extra_info("peername")
        slot = self.slots.admit(str(peer[0]) if isinstance(peer, tuple) else str(peer), task)
        if slot is None:
            writer.close()
            return
        self._conns.add(task)
        try:
            await self._handler(reader, writer, slot)
        except SlotEnded:
            pass  # counted and logged where it ended
        except asyncio.CancelledError:
            # `close()`: end quietly. Python 3.11's stream server asks the finished task for its
            # exception without checking for a cancellation, which logs a cancelled task as an error.
            pass
        finally:
            self.slots.release(slot)
            self._conns.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
