"""The control-plane bus: a narrow interface over NATS, and an in-process twin for tests.

`Bus` (all methods are coroutines on the service's event loop; none blocks the loop):
  - `publish(subject, data)`                 fire-and-forget event (senders, brokers)
  - `request(subject, data, timeout)`        one request, one reply or TimeoutError (clients)
  - `subscribe(subject, handler, queue)`     events to `handler` (broker, receivers)
  - `subscribe_from(pattern, handler)`       events to `handler(subject, data)`: for a receiver of
                                             per-sender subjects that must know who spoke (the broker)
  - `serve(subject, handler, queue)`         request/reply endpoint; one copy of `queue` answers
  - `config_board()`                         the recompute-config board over the same connection
  - `maps_store()`                           the SCD maps files published with those configs
                                             (plain method; callers never reach the client under it)
  - `close()`                                drain and disconnect (its owner, once, at shutdown)
Payloads are bytes of `shared.wire.schemas` messages; decoding and error replies live in
`shared/service/wrappers.py`, so a bus never interprets what it carries.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import structlog

from droidmesh.shared.mesh.caller import CALLER, user_of
from droidmesh.shared.mesh.config_board import ConfigBoard, InMemoryConfigBoard, NatsConfigBoard
from droidmesh.shared.mesh.maps_store import InMemoryMapsStore, MapsStore, NatsMapsStore

RequestHandler = Callable[[bytes], Coroutine[Any, Any, bytes]]
EventHandler = Callable[[bytes], Coroutine[Any, Any, None]]
SubjectHandler = Callable[[str, bytes], Coroutine[Any, Any, None]]

log = structlog.get_logger("bus")
ERROR_LOG_EVERY_S = 10.0  # at most one nats_error line this often (the rest are counted)


class Bus(Protocol):
    async def publish(self, subject: str, data: bytes) -> None: ...

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes: ...

    async def subscribe(self, subject: str, handler: EventHandler, queue: str | None = None) -> None: ...

    async def subscribe_from(self, pattern: str, handler: SubjectHandler) -> None: ...

    async def serve(self, subject: str, handler: RequestHandler, queue: str,
                    metadata: dict[str, str] | None = None) -> None: ...

    def config_board(self) -> ConfigBoard: ...

    def maps_store(self) -> MapsStore: ...

    async def close(self) -> None: ...


class NatsBus:
    """`Bus` over a nats-py connection; `serve` endpoints are NATS micro endpoints, so every
    service answers `$SRV.PING/INFO/STATS` discovery under its service name."""

    def __init__(self, nc: Any, service_name: str, version: str):
        self.nc = nc
        self._service_name = service_name
        self._version = version
        self._micro: Any = None
        self._subs: list[Any] = []
        self._inflight: set[asyncio.Task] = set()  # requests being answered

    @classmethod
    async def connect(cls, url: str | None, service_name: str, version: str, **options: Any) -> NatsBus:
        """Connect (reconnecting forever by default); `options` go to `nats.connect` as is."""
        import nats

        at: dict[str, Any] = {}  # the client once connected, and the server it was last connected to

        def server() -> str:
            now = at["nc"].connected_url if "nc" in at else None
            if now is not None:
                at["server"] = f"{now.hostname}:{now.port}"  # never the credentials a URL may carry
            return at.get("server", "?")

        errors = {"last": 0.0, "skipped": 0}

        async def on_error(e: Exception) -> None:
            # while NATS is down the client retries every reconnect_time_wait and reports each
            # failure: one line per ERROR_LOG_EVERY_S, with how many were left out
            now = time.monotonic()
            if now - errors["last"] < ERROR_LOG_EVERY_S:
                errors["skipped"] += 1
                return
            log.warning("nats_error", error=str(e), skipped=errors["skipped"])
            errors["last"], errors["skipped"] = now, 0

        async def on_disconnected() -> None:
            if "nc" in at and not at["nc"].is_closed:  # lost, not closed by its owner
                log.warning("nats_disconnected", server=server())

        async def on_reconnected() -> None:
            log.info("nats_reconnected", server=server())

        opts: dict[str, Any] = {"name": service_name, "error_cb": on_error, "disconnected_cb": on_disconnected,
                                "reconnected_cb": on_reconnected, "max_reconnect_attempts": -1,
                                "reconnect_time_wait": 0.5, **options}
        if url is not None:  # one URL, or a comma-separated list (every node of a cluster)
            opts["servers"] = [u.strip() for u in url.split(",") if u.strip()]
        nc = await nats.connect(**opts)
        at["nc"] = nc
        server()
        return cls(nc, service_name, version)

    async def publish(self, subject: str, data: bytes) -> None:
        await self.nc.publish(subject, data)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        import nats.errors

        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            raise TimeoutError(f"no reply on {subject} within {timeout:.3g}s ({type(e).__name__})") from e
        return msg.data

    async def subscribe(self, subject: str, handler: EventHandler, queue: str | None = None) -> None:
        async def cb(msg: Any) -> None:
            await handler(msg.data)

        self._subs.append(await self.nc.subscribe(subject, queue=queue or "", cb=cb))

    async def subscribe_from(self, pattern: str, handler: SubjectHandler) -> None:
        async def cb(msg: Any) -> None:
            await handler(msg.subject, msg.data)

        self._subs.append(await self.nc.subscribe(pattern, cb=cb))

    async def serve(self, subject: str, handler: RequestHandler, queue: str,
                    metadata: dict[str, str] | None = None) -> None:
        """Answer `subject` in queue group `queue`; `metadata` is published with the endpoint's
        `$SRV.INFO` (see `shared/mesh/discovery.py`)."""
        from nats import micro

        if self._micro is None:
            self._micro = await micro.add_service(self.nc, name=self._service_name, version=self._version)

        async def respond(req: Any) -> None:
            # the asker's identity, for this request's task only (`shared/mesh/caller.py`)
            CALLER.set(user_of(getattr(getattr(req, "_msg", None), "reply", None)))
            reply = await handler(req.data)  # never raises: handlers are wrapped by service_kit.rpc
            try:
                await req.respond(reply)
            except Exception as e:  # connection lost meanwhile: the caller retries with the same id
                log.warning("reply_failed", subject=subject, error=repr(e))

        async def endpoint(req: Any) -> None:
            # nats-py runs a subscription's callbacks one at a time; a task per request lets a
            # service overlap requests (one's transfer with another's compute).
            task = asyncio.get_running_loop().create_task(respond(req))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        name = subject.replace(".", "-").replace("*", "any").replace(">", "all")
        await self._micro.add_endpoint(name=name, subject=subject, handler=endpoint, queue_group=queue,
                                      metadata=metadata or {})

    async def flush(self, timeout: float = 10.0) -> None:
        """Return once the server has processed everything sent so far: every subscription and
        endpoint made before it is live (a service says it is ready only after this)."""
        await self.nc.flush(timeout=timeout)

    def config_board(self) -> ConfigBoard:
        """The JetStream key-value board on this connection (a new handle per call)."""
        return NatsConfigBoard(self.nc)

    def maps_store(self) -> MapsStore:
        return NatsMapsStore(self.nc)

    async def close(self) -> None:
        """Drain: stop taking new requests (queue-group siblings get them), finish and answer
        every request already taken, then flush and disconnect."""
        if self._micro is not None:
            await self._micro.stop()
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        if self.nc.is_connected:
            await self.nc.drain()
        elif not self.nc.is_closed:  # reconnecting: nothing to drain through, just stop
            await self.nc.close()


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` one or more."""
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


class InProcessBus:
    """`Bus` inside one event loop, for integration tests: NATS wildcards, queue groups round-robin."""

    def __init__(self) -> None:
        self._events: dict[str, list[tuple[str | None, EventHandler]]] = defaultdict(list)
        self._from: dict[str, list[SubjectHandler]] = defaultdict(list)
        self._servers: dict[str, list[RequestHandler]] = defaultdict(list)
        self._rr: dict[str, itertools.count] = defaultdict(itertools.count)
        self._tasks: set[asyncio.Task] = set()
        self._board = InMemoryConfigBoard()
        self._maps = InMemoryMapsStore()

    async def publish(self, subject: str, data: bytes) -> None:
        seen_queues: set[str] = set()
        handlers = [(q, h) for pattern, subs in list(self._events.items()) if subject_matches(pattern, subject)
                    for q, h in subs]
        for queue, handler in handlers:
            if queue is not None:
                if queue in seen_queues:
                    continue
                seen_queues.add(queue)
                group = [h for q, h in handlers if q == queue]
                handler = group[next(self._rr[subject + queue]) % len(group)]
            self._spawn(handler(data))
        for pattern, subject_handlers in list(self._from.items()):
            if subject_matches(pattern, subject):
                for h in subject_handlers:
                    self._spawn(h(subject, data))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        servers = self._servers.get(subject)
        if not servers:
            raise TimeoutError(f"no responders on {subject}")
        handler = servers[next(self._rr[subject]) % len(servers)]
        return await asyncio.wait_for(handler(data), timeout)

    async def subscribe(self, subject: str, handler: EventHandler, queue: str | None = None) -> None:
        self._events[subject].append((queue, handler))

    async def subscribe_from(self, pattern: str, handler: SubjectHandler) -> None:
        self._from[pattern].append(handler)

    async def serve(self, subject: str, handler: RequestHandler, queue: str,
                    metadata: dict[str, str] | None = None) -> None:
        self._servers[subject].append(handler)

    def config_board(self) -> ConfigBoard:
        """One in-memory board per bus, shared by every service on it (as a NATS bucket is)."""
        return self._board

    def maps_store(self) -> MapsStore:
        return self._maps

    async def settle(self) -> None:
        """Wait until every delivered event has been handled (tests only)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def close(self) -> None:
        await self.settle()
