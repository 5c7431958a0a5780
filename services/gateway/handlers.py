"""The gateway's HTTP handlers (aiohttp) and the middleware every request passes through.

The middleware gives each request its ids, runs it, turns whatever it raised into an OpenAI
error response (through `openai.to_http`, the one mapping), counts it and writes the one
canonical `request` log line. Handlers only parse, call the mesh and shape the answer.

Ids: `request_id` is the client's `x-request-id` when it looks sane (else generated) and is
echoed in the response header and every log line; the mesh is always called with a fresh
`mesh_request_id`, because receivers answer a repeated request id from their reply cache and a
client-chosen id must never return another request's answer. The response's `id` uses it too.

Deadline: `request_timeout_s` from the config; a client may lower it (never raise it) with the
header `x-request-timeout: <seconds>`. The body must arrive within `body_timeout_s` (408).

Admission: while a request runs its connection is busy (`guard.ConnectionGuard`: idle ones are
what the connection cap closes first) and it counts against its client's in-flight limits
(`fairness.ClientLimits`: 429 above). A response is sent in full before its connection is idle.
With a key file every request needs a key (`shared.auth.keys`: 401), its model must be one the
key may use (403, checked before the model's existence, so a key learns nothing of others'
models) and it counts against the key's quotas (`shared.auth.shared_quota`, shared by the gateway's
replicas: 429 with `Retry-After`). The key's id and tenant are in the request's log line and
per-key metrics; the key never is. A request reads and is held in its key's tenant scope, narrowed
by its `cache_salt` when it sends one (`openai.salted_scope`).

`GET /health` is the one route that needs no key: a probe's answer on the API port itself (the
metrics port keeps /livez /readyz), 200 `{"status": "ok", "models": [...]}` while the gateway is
connected to the mesh, with the models /v1/models lists, and 503 `{"status": "unavailable"}`
otherwise. With a key file the list is left out: which models exist is for keys to learn.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from droidmesh.services.gateway import fairness, openai, responses
from droidmesh.services.gateway.state import GatewayState
from droidmesh.shared.auth.keys import ApiKey
from droidmesh.shared.auth.shared_quota import Reservation
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.hashing import PUBLIC, tenant_scope

log = structlog.get_logger("gateway")
STATE: web.AppKey[GatewayState] = web.AppKey("state", GatewayState)
SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
OPEN_ROUTES = frozenset({"/health"})  # answered without an API key
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclasses.dataclass
class RequestContext:
    request_id: str
    mesh_request_id: str
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the canonical log line adds
    key: ApiKey | None = None  # the authenticated key (None: the gateway has no key file)
    reserved: Reservation | None = None  # tokens reserved from the key's budget, settled when the request ends
    used: int = 0  # tokens the reply used (prompt + completion)


# aiohttp runs each request in its own task, so a context variable set by the middleware is this
# request's alone (and needs no per-version aiohttp request-storage keys).
CURRENT: contextvars.ContextVar[RequestContext] = contextvars.ContextVar("gateway_request")


def make_app(state: GatewayState) -> web.Application:
    # client_max_size makes aiohttp refuse a larger body (chunked or not) while reading it.
    app = web.Application(middlewares=[_middleware], client_max_size=state.cfg.max_body_bytes)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    given = request.headers.get("x-request-id", "")
    mesh_id = uuid.uuid4().hex[:16]
    rid = given if SANE_ID.fullmatch(given) else mesh_id
    ctx = RequestContext(rid, mesh_id)
    reset = CURRENT.set(ctx)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"  # bounded label values
    began = time.monotonic()
    state.metrics.gateway_inflight.inc()
    state.guard.busy(request.protocol)
    peer = fairness.peer_of(request.remote)
    failure: BaseException | None = None
    authorization = request.headers.get("authorization", "")
    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            async with contextlib.AsyncExitStack() as admitted:
                admitted.enter_context(state.clients.admit(peer, fairness.key_digest(authorization)))
                if state.keys is not None and route not in OPEN_ROUTES:
                    ctx.key = key = state.keys.authenticate(authorization)
                    ctx.facts.update(key_id=key.id, tenant=key.tenant)
                    await admitted.enter_async_context(state.quotas.admit(key))
                resp = await handler(request)
        except Exception as e:
            failure = e
            status, body = openai.to_http(e, rid)
            ctx.facts["error"] = body["error"]["code"]
            resp = web.json_response(body, status=status, headers=openai.error_headers(e))
        finally:
            state.metrics.gateway_inflight.dec()
            CURRENT.reset(reset)
            if ctx.key is not None and ctx.reserved is not None:  # a failed request gives its reservation back
                state.quotas.settle(ctx.key, ctx.reserved, ctx.used)
        if not resp.prepared:  # a stream set it before its first byte
            resp.headers["x-request-id"] = rid
        try:  # sent in full here (aiohttp then finds it sent), so the connection is idle only after it
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionResetError:
            ctx.facts["client_gone"] = True
        finally:
            state.guard.idle(request.protocol)
        seconds = time.monotonic() - began
        state.metrics.gateway_requests.labels(route, str(resp.status)).inc()
        state.metrics.gateway_seconds.labels(route).observe(seconds)
        if ctx.key is not None:
            state.metrics.gateway_key_requests.labels(ctx.key.id, str(resp.status)).inc()
        internal = failure is not None and resp.status == 500
        log.info("request", method=request.method, route=route, status=resp.status, mesh_request_id=mesh_id,
                 duration_ms=round(seconds * 1e3, 2), **ctx.facts,
                 **({"error_detail": repr(failure), "exc_info": failure} if internal else {}))
    return resp


def _check_allowed(model: str) -> None:
    """403 unless the request's key (if the gateway has keys) may use `model`."""
    key = CURRENT.get().key
    if key is not None and not key.allows(model):
        raise openai.ModelNotAllowedError(f"this API key may not use the model {model!r}", param="model")


async def health(request: web.Request) -> web.Response:
    """200 with the models discovered while the mesh is connected, else 503 (never an error body:
    a probe reads `status`). Discovery is the one /v1/models shares (at most every `models_ttl_s`)."""
    state = request.app[STATE]
    try:
        models = await state.models()
    except openai.MeshUnavailableError as e:
        return web.json_response({"status": "unavailable", "reason": str(e)}, status=503)
    body: dict[str, Any] = {"status": "ok"}
    if state.keys is None:
        body["models"] = sorted(m.model_id for m in models)
    return web.json_response(body)


async def list_models(request: web.Request) -> web.Response:
    state, key = request.app[STATE], CURRENT.get().key
    models = [m for m in await state.models() if key is None or key.allows(m.model_id)]
    return web.json_response(responses.models_body(state.model_rows(models)))


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model"]
    _check_allowed(model)
    await state.check_model(model)
    (row,) = [r for r in state.model_rows(await state.models()) if r[0] == model]
    return web.json_response(responses.model_entry(*row))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, openai.parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, openai.parse_chat)


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    declared = request.content_length
    if declared is not None and declared > limit:  # refuse before reading a byte of it
        raise openai.BodyTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit}")
    try:
        async with asyncio.timeout(timeout_s):  # a body trickled in byte by byte holds a connection no longer
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise openai.BodyTooLargeError(f"request body exceeds the limit of {limit} bytes") from None
    except TimeoutError:
        raise openai.BodyTimeoutError(f"the request body did not arrive within {timeout_s:g}s") from None


def _timeout(request: web.Request, default: float) -> float:
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise openai.InvalidRequestError(f"x-request-timeout must be positive seconds, got {raw[:32]!r}",
                                         param="x-request-timeout")
    return min(value, default)


async def _generate(request: web.Request, parse: Callable[[bytes, openai.Limits], openai.MeshCall]) -> web.StreamResponse:
    state, ctx = request.app[STATE], CURRENT.get()
    facts = ctx.facts
    call = parse(await _read_body(request, state.cfg.max_body_bytes, state.cfg.body_timeout_s), state.limits)
    facts.update(model=call.model, kind=call.kind, stream=call.stream, max_new_tokens=call.max_new_tokens)
    _check_allowed(call.model)
    if ctx.key is not None:
        ctx.reserved = await state.quotas.reserve(ctx.key, call.max_new_tokens * call.n)
    timeout = _timeout(request, state.cfg.request_timeout_s)
    async with asyncio.timeout(timeout):  # discovery counts against the deadline too
        await state.check_model(call.model)
    mesh_id = ctx.mesh_request_id
    # A key's requests reuse only their tenant's cached contexts and public ones (so a reply's
    # reuse fields and timing say nothing of another tenant's); without keys every request is public.
    # A `cache_salt` narrows that to the requests with the same salt (and key tenant), as vLLM's does.
    scope = openai.salted_scope((ctx.key.scope or tenant_scope(ctx.key.tenant)) if ctx.key is not None else PUBLIC,
                                call.cache_salt)
    if call.cache_salt is not None:
        facts["cache_salt"] = True  # that one was sent, never its value
    kwargs: dict[str, Any] = dict(max_new_tokens=call.max_new_tokens, timeout=timeout, request_id=mesh_id,
                                  sampling=call.sampling, chat=call.chat, scope=scope)
    created = int(time.time())
    if call.stream:
        return await _stream(request, state, call, kwargs, created)
    async with asyncio.timeout(timeout):  # the client has its own; this also bounds one that overruns it
        reply = await state.client.ask(call.model, call.context, call.question, n=call.n, **kwargs)
    _account(state, ctx, reply)
    return web.json_response(responses.completion_body(call, mesh_id, created, reply))


async def _stream(request: web.Request, state: GatewayState, call: openai.MeshCall, kwargs: dict[str, Any],
                  created: int) -> web.StreamResponse:
    """Server-sent events. Until the mesh's first item arrives nothing is sent, so a request the
    mesh refuses at once is an ordinary HTTP error; after that an error is one `error` event. A
    client that goes away ends only its own stream (the async iterator is closed)."""
    ctx = CURRENT.get()
    facts = ctx.facts
    enc = responses.SseEncoder(call, ctx.mesh_request_id, created)
    items = state.client.stream(call.model, call.context, call.question, **kwargs)
    resp: web.StreamResponse | None = None
    try:
        async with asyncio.timeout(kwargs["timeout"]):
            async for item in items:
                frame = enc.final(item) if isinstance(item, schemas.GenerateReply) else enc.chunk(item)
                if resp is None:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                       "x-request-id": ctx.request_id})
                    await resp.prepare(request)
                if frame:
                    await resp.write(frame)
                if enc.reply is not None:
                    break
        if enc.reply is None:
            raise openai.ApiError("the mesh ended the stream without a final reply")
        _account(state, ctx, enc.reply)
    except ConnectionResetError:  # the client went away: stop writing, close only this stream
        if resp is None:
            raise
        facts["client_gone"] = True
    except Exception as e:
        if resp is None:
            raise  # nothing sent yet: the middleware answers with a plain HTTP error
        _, body = openai.to_http(e, ctx.request_id)
        facts["error"] = body["error"]["code"]
        with contextlib.suppress(ConnectionResetError):
            await resp.write(responses.sse(body))
    finally:
        if resp is not None and enc.reply is None:  # ended mid-stream (client gone, cancelled, failed):
            ctx.used = max(ctx.used, ctx.reserved.tokens if ctx.reserved else 0)  # what was sent is not free
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
    assert resp is not None  # every path that leaves it None raised above
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def _account(state: GatewayState, ctx: RequestContext, reply: schemas.GenerateReply) -> None:
    ctx.facts.update(responses.log_facts(reply))
    completion = responses.completion_tokens(reply)
    ctx.used = reply.prompt_tokens + completion  # charged to the key when the request ends
    counts = {"prompt": reply.prompt_tokens, "completion": completion, "reused": reply.reused_tokens}
    for kind, n in counts.items():
        state.metrics.gateway_tokens.labels(kind).inc(n)
        if ctx.key is not None:
            state.metrics.gateway_key_tokens.labels(ctx.key.id, kind).inc(n)
