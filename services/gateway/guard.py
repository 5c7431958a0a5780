"""Admission at the socket: the API's own accept loop and a cap on open connections.

Why not `loop.create_server`: when descriptors run out, asyncio's accept loop (CPython 3.11)
keeps calling `accept()` for the rest of its batch after an EMFILE, logging each failure and
re-arming itself once per failure, so one exhausted moment turns into a hot loop of log lines
while every client times out. Here (`Listener`):
  - a failed accept pauses accepting for `ACCEPT_PAUSE_S` (once), logged at most once per
    `LOG_EVERY_S` with how many failures that line stands for;
  - every accepted socket passes `ConnectionGuard.admit` first. Connections are capped at
    `cap`, kept below the process's descriptor limit (`connection_cap`), so accepting never
    reaches EMFILE in the first place. At the cap the connection idle longest (no request in
    flight: idle connections are what a slow-loris attack holds) is closed to make room; when
    every connection has a request in flight the newcomer gets a one-line 503 and is closed.

Idle connections also expire on their own: aiohttp's keep-alive timeout (the gateway sets it to
`header_timeout_s`) closes a connection that has not completed a request head within that time,
counted from its start or from the end of its previous response; partial header bytes do not
extend it. The body has its own deadline (`handlers._read_body`).

Everything here runs on the event loop; nothing blocks (sockets are non-blocking).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import time
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger("gateway")

ACCEPT_BATCH = 64  # sockets accepted per readiness event (then the loop serves others)
ACCEPT_PAUSE_S = 0.5  # how long accepting stops after a failed accept (descriptors exhausted)
LOG_EVERY_S = 10.0  # at most one line per kind of admission event in this long
DESCRIPTOR_RESERVE = 160  # kept free for NATS, logs, a burst being closed (< ACCEPT_BATCH * 2)


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered so that the open connections plus what the process holds now plus a
    reserve stay under the soft descriptor limit (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a typical start-up's worth
        held = 64
    return max(1, min(wanted, soft - held - DESCRIPTOR_RESERVE))


class _RateLimited:
    """A log event emitted at most once per `LOG_EVERY_S`, with the count it stands for."""

    def __init__(self, event: str) -> None:
        self.event, self.total, self._since, self._last = event, 0, 0, float("-inf")

    def hit(self, **facts: Any) -> None:
        self.total += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= LOG_EVERY_S:
            log.warning(self.event, count=self._since, total=self.total, **facts)
            self._last, self._since = now, 0


def refusal_bytes(message: str) -> bytes:
    """A complete HTTP/1.1 503 response with OpenAI's error body, closing the connection."""
    body = msgspec.json.encode({"error": {"message": message, "type": "server_error", "param": None,
                                          "code": "service_unavailable"}})
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    """The open connections (aiohttp handlers with their transports), which of them are idle, and
    the cap. The handlers' middleware marks a connection `busy` while a request runs on it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[RequestHandler, asyncio.BaseTransport] = {}
        self._idle: dict[RequestHandler, None] = {}  # idle connections, longest idle first
        self._pending = 0  # admitted sockets whose handler is not made yet
        self._refused = _RateLimited("connection_refused_at_cap")
        self._evicted = _RateLimited("idle_connection_evicted")
        self._refusal = refusal_bytes(f"the gateway holds its limit of {cap} connections, each with a request "
                                      "in flight; retry shortly")

    @property
    def open(self) -> int:
        return len(self._open) + self._pending

    def admit(self) -> bool:
        """Room for one more connection (closing the longest-idle one if the cap is reached)?"""
        if self.open < self.cap:
            return True
        self._forget_closed()
        if self.open < self.cap:
            return True
        for handler in self._idle:  # oldest first
            transport = self._open.get(handler)
            if transport is not None and not transport.is_closing():
                handler.force_close()  # closes its transport: the descriptor goes on the next loop turn
                self._forget(handler)
                self._evicted.hit(open=self.open, cap=self.cap)
                return True
        return False

    def refuse(self, conn: socket.socket) -> None:
        """Answer a socket the cap leaves no room for with a 503 and close it (best effort: the
        response is small enough for an empty socket buffer)."""
        self._refused.hit(open=self.open, cap=self.cap)
        with contextlib.suppress(OSError):
            with contextlib.suppress(BlockingIOError):
                conn.recv(65536)  # what the client sent already: closing over unread bytes would reset
            conn.send(self._refusal)
            conn.shutdown(socket.SHUT_WR)
        conn.close()

    def reserve(self) -> None:
        self._pending += 1

    def opened(self, handler: RequestHandler | None, transport: asyncio.BaseTransport | None) -> None:
        self._pending -= 1
        if handler is not None and transport is not None:
            self._open[handler] = transport
            self._idle[handler] = None

    def busy(self, handler: object) -> None:
        if handler in self._open:
            self._idle.pop(handler, None)

    def idle(self, handler: object) -> None:
        if handler in self._open:
            self._idle[handler] = None  # the newest idle: evicted last

    def _forget(self, handler: RequestHandler) -> None:
        self._open.pop(handler, None)
        self._idle.pop(handler, None)

    def _forget_closed(self) -> None:
        for handler in [h for h, t in self._open.items() if t.is_closing()]:
            self._forget(handler)


class Listener:
    """One listening socket with the accept loop of the module docstring; quacks like the
    `asyncio.Server` aiohttp keeps for a site (`sockets`, `close`)."""

    def __init__(self, sock: socket.socket, server: web.Server, guard: ConnectionGuard) -> None:
        self._sock, self._server, self._guard = sock, server, guard
        self._loop = asyncio.get_running_loop()
        self._resume: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._failed = _RateLimited("accept_failed")
        self._closed = False

    @property
    def sockets(self) -> list[socket.socket]:
        return [] if self._closed else [self._sock]

    def start(self) -> None:
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: stop accepting for a while
                self._pause(e)
                return
            conn.setblocking(False)
            if not self._guard.admit():
                self._guard.refuse(conn)
                continue
            self._guard.reserve()
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        handler = transport = None
        try:
            transport, handler = await self._loop.connect_accepted_socket(self._server, sock=conn)
        except OSError:  # the peer left before the transport was made
            conn.close()
        finally:
            self._guard.opened(handler if isinstance(handler, RequestHandler) else None, transport)

    def _pause(self, e: OSError) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._failed.hit(error=errno.errorcode.get(e.errno or 0, str(e.errno)), pause_s=ACCEPT_PAUSE_S)
        self._resume = self._loop.call_later(ACCEPT_PAUSE_S, self._resumed)

    def _resumed(self) -> None:
        self._resume = None
        if not self._closed:
            self.start()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass `guard` (aiohttp's `TCPSite`, with the `Listener`)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner is set up before its sites start
        family, _, _, _, address = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        sock = socket.create_server(address[:2], family=family, backlog=self._backlog)
        sock.setblocking(False)
        listener = Listener(sock, server, self._guard)
        listener.start()
        self._server = listener  # type: ignore[assignment]  # aiohttp reads only `sockets` and `close()`
        self._port = sock.getsockname()[1]
