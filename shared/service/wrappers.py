"""What every service's handlers share: the one error-reply wrapper and the event wrapper.

The lifecycle (bus, torch thread, background loops, health, signals) is `shared/service/runtime.py`.

`rpc` is the only place exceptions become `ErrorReply`s: it decodes the request (bad bytes ->
a specific error reply), runs the handler, and encodes its reply; a `DroidMeshError` keeps its
code, anything else is logged with its traceback and answered as `internal`. A handler can
therefore never crash a service or leave a caller without an answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from droidmesh.shared.alarms import alarm
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.mesh.bus import EventHandler, RequestHandler
from droidmesh.shared.wire import schemas

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
        except DroidMeshError as e:  # malformed, another schema version, refused: an alarm, not a crash
            alarm(kind.__name__, e.code)
            log.warning("event_rejected", kind=kind.__name__, code=e.code, error=str(e))
        except Exception:
            log.exception("event_crashed", kind=kind.__name__)

    return on_event
