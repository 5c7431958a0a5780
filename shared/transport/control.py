"""The sender side of a bulk channel's TCP control stream: one listener bound to the configured host.

Used by the NIXL channel (grants) and the UCX channel (worker-address wireup). Called from a bulk
server's `start` and `close`, on the event loop:
  - `start(host, port)` binds the host's first address only (one socket, so one port even when
    the port is 0: ephemeral) and returns ("host:port" with the configured host, the bound
    (address, port)); it never binds the wildcard address.
  - each accepted connection runs `handler(reader, writer)` as its own task; at most
    `max_connections` run at once, and one more is closed on arrival, before a byte is read;
    the writer is closed when the handler returns (whatever the handler did first stays first).
  - `close()` stops listening, cancels the connections' tasks and waits for them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("transport")

MAX_CONNECTIONS = 256  # control connections served at once per sender (more are closed on arrival)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ControlListener:
    def __init__(self, name: str, handler: Handler, max_connections: int = MAX_CONNECTIONS):
        self._name, self._handler, self._max = name, handler, max_connections
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
        if len(self._conns) >= self._max:
            log.warning(f"{self._name}_connection_refused", reason=f"{self._max} connections already served")
            writer.close()
            return
        self._conns.add(task)
        try:
            await self._handler(reader, writer)
        finally:
            self._conns.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
