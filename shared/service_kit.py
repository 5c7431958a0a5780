"""What every service shares: the one error-reply wrapper, event wrappers, and the run loop.

`rpc` is the only place exceptions become `ErrorReply`s: it decodes the request (bad bytes ->
a specific error reply), runs the handler, and encodes its reply; a `DroidMeshError` keeps its
code, anything else is logged with its traceback and answered as `internal`. A handler can
therefore never crash a service or leave a caller without an answer.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

from shared.bus import EventHandler, RequestHandler
from shared.errors import DroidMeshError
from shared.metrics import HealthServer, Metrics
from shared.wire import schemas

log = structlog.get_logger("service")
Req = TypeVar("Req", bound=schemas.Message)


def rpc(kind: type[Req], handler: Callable[[Req], Awaitable[schemas.Message]]) -> RequestHandler:
    """Wrap a typed handler as a bytes -> bytes endpoint that always replies."""

    async def endpoint(data: bytes) -> bytes:
        request_id = None
        try:
            req = schemas.decode(data, kind)
            request_id = getattr(req, "request_id", None)
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                return schemas.encode(await handler(req))
        except DroidMeshError as e:
            log.warning("request_failed", kind=kind.__name__, code=e.code, error=str(e), request_id=request_id)
            return schemas.encode(schemas.ErrorReply(code=e.code, message=str(e), request_id=request_id))
        except Exception as e:  # the last line of defence: reply, log the traceback, keep serving
            log.exception("request_crashed", kind=kind.__name__, request_id=request_id)
            return schemas.encode(schemas.ErrorReply(code="internal", message=repr(e), request_id=request_id))

    return endpoint


def event(kind: type[Req], handler: Callable[[Req], Awaitable[None]]) -> EventHandler:
    """Wrap a typed event handler: bad events and handler errors are logged, never raised."""

    async def on_event(data: bytes) -> None:
        try:
            await handler(schemas.decode(data, kind))
        except DroidMeshError as e:
            log.warning("event_rejected", kind=kind.__name__, code=e.code, error=str(e))
        except Exception:
            log.exception("event_crashed", kind=kind.__name__)

    return on_event


async def run_in(executor: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking torch work on `executor` (a service's single worker thread), never on the loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))


class Background:
    """Named background tasks, referenced until done, cancelled and awaited on close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def run_until_signalled(service: Any) -> None:
    """Enter `service` (an async context manager), run until SIGTERM/SIGINT, then exit it cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with service:
        log.info("ready")
        await stop.wait()
        log.info("stopping")
    log.info("stopped")


def start_health(metrics: Metrics, port: int) -> HealthServer | None:
    """Serve /metrics /livez /readyz on `port` (0: any free port, logged; -1: off)."""
    if port < 0:
        return None
    health = HealthServer(metrics, port)
    health.start()
    log.info("health_listening", port=health.port)
    return health
