"""OpenAI's API shapes and their conversion to and from the mesh: pure functions, no I/O.

Requests decode into msgspec Structs that refuse unknown fields and bound every size and range,
so nothing reaches the mesh with a field of the wrong type or an unbounded list. Parameters
OpenAI defines that the mesh cannot honour (`tools`, `echo`, `best_of`, ...) pass only at their
neutral value (`NEUTRAL`); any other value is a 400 naming the parameter. Log-probabilities are
served without streaming: chat's `logprobs` / `top_logprobs` (0..20) and completions' `logprobs`
(0..5), each token's under the model's distribution before temperature and top-p; so are `n`
samples (up to MAX_N), which share the receiver's prefill and decode together. A completion's prompt
is the mesh's `context` (so a prompt starting with a context a sender prefilled reuses its cache)
and a chat is rendered by the receiver's own chat template. `cache_salt` (a non-empty string, as
vLLM's server takes it) makes the request's cache scope a sub-scope of its tenant's (`salted_scope`).

Errors: the `ApiError` classes below extend `shared.errors`, and `to_http` is the one place
where any exception (these, the mesh's `MeshError`, timeouts, aiohttp's own HTTP errors) becomes
an HTTP status and OpenAI's `{"error": {message, type, param, code}}` body. The answers' shapes
(JSON bodies, server-sent events) are `responses.py`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web

from droidmesh.shared.errors import BadRequestError, DroidMeshError, PermissionDeniedError, QuotaExceededError
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest, Sampling
from droidmesh.shared.wire.hashing import PUBLIC, check_scope

Text = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
StopList = Annotated[list[Text], msgspec.Meta(min_length=1, max_length=4)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
MAX_N = 8  # samples per request (each holds a copy of the prompt's cache at the receiver)
# Receivers' seed range (`shared.model.sampling.MAX_SEED`, not imported: that module loads torch);
# an unbounded JSON integer would pass decoding here and then fail the bus's msgpack encoding.
MAX_SEED = 2**63 - 1
MAX_SALT_CHARS = 1024  # only its hash travels
SALT_HEX = 20  # the salt's part of a scope: 80 bits, and a tenant's scope (<= 104 characters) stays within 128


# -- errors ---------------------------------------------------------------------------------
class ApiError(DroidMeshError):
    """An error the gateway raises itself; `param` names the offending request field, if one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequestError(ApiError, BadRequestError):
    code = "invalid_value"


class InvalidJSONError(InvalidRequestError):
    code = "invalid_json"


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"


class BodyTooLargeError(InvalidRequestError):
    code = "request_too_large"


class ModelNotFoundError(ApiError):
    code = "model_not_found"


class ModelNotAllowedError(ApiError, PermissionDeniedError):
    """A valid API key naming a model its entry does not list."""


class MeshUnavailableError(ApiError):
    """NATS is down, discovery failed, or no receiver of a known model answers."""

    code = "service_unavailable"


class RateLimitedError(QuotaExceededError):
    """A client (or its address) already has as many requests in flight as it may (`fairness.py`)."""


class BodyTimeoutError(ApiError):
    """The request body did not arrive within `body_timeout_s`."""

    code = "request_timeout"


# Error code -> HTTP status; every code not listed (the mesh's `internal`, ...) is a 500.
STATUS = {
    "invalid_value": 400, "invalid_json": 400, "unsupported_parameter": 400,
    "bad_request": 400, "bad_message": 400, "schema_version": 400,  # the mesh refused the request itself
    "invalid_api_key": 401, "permission_denied": 403,
    "model_not_found": 404, "request_timeout": 408, "request_too_large": 413, "rate_limit_exceeded": 429,
    "service_unavailable": 503, "overloaded": 503,  # a receiver shedding load: retry later (not a server fault)
    "deadline_exceeded": 504,
}


def to_http(exc: BaseException, request_id: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for any exception a request ended with."""
    param: str | None = None
    if isinstance(exc, web.HTTPException):  # aiohttp's own: unknown route, wrong method
        status, code, message = exc.status, re.sub(r"\W+", "_", exc.reason.lower()), exc.reason
    elif isinstance(exc, TimeoutError):
        # nats-py's "no responders" reaches us as a TimeoutError caused by NoRespondersError:
        # nobody serves the model right now (503), which is not a deadline passing (504).
        if type(exc.__cause__).__name__ == "NoRespondersError":
            status, code, message = 503, "service_unavailable", "no receiver of this model is answering"
        else:
            status, code, message = 504, "deadline_exceeded", "the request's deadline passed"
    elif isinstance(exc, DroidMeshError):
        code = exc.code
        status, message, param = STATUS.get(code, 500), str(exc), getattr(exc, "param", None)
    elif type(exc).__module__.startswith("nats"):  # connection closed / lost mid-request
        status, code, message = 503, "service_unavailable", "the mesh's control plane is unreachable"
    else:
        status, code, message = 500, "internal", ""
    if status >= 500 and status not in (503, 504):
        message = f"internal error (request id {request_id})"  # never leak a peer's traceback or repr
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_headers(exc: BaseException) -> dict[str, str]:
    """Headers an error response carries besides its body: `Retry-After` (whole seconds) on a 429."""
    if isinstance(exc, QuotaExceededError):
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return {}


# -- requests -------------------------------------------------------------------------------
class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Text
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    stop: Text | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # accepted, unused
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SALT_CHARS)] | None = None  # vLLM's
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None  # samples, answered whole (not streamed)
    # OpenAI parameters the mesh cannot honour: accepted only at their neutral value (NEUTRAL).
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None


class CompletionRequest(_Request, kw_only=True, forbid_unknown_fields=True):
    prompt: Annotated[str, msgspec.Meta(min_length=1)]  # OpenAI also takes lists and token ids: a string only here
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None  # the k likeliest per token, as OpenAI's legacy API
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=64)]
    name: Annotated[str, msgspec.Meta(max_length=64)] | None = None  # accepted, unused


class ChatRequest(_Request, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1, max_length=1024)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


R = TypeVar("R", bound=_Request)


@dataclasses.dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    max_tokens_limit: int


@dataclasses.dataclass(frozen=True)
class MeshCall:
    """One request, as the mesh client is called with it."""

    kind: Literal["completion", "chat"]
    model: str
    context: str
    question: str
    chat: list[schemas.ChatMessage] | None
    sampling: Sampling
    max_new_tokens: int
    stream: bool
    include_usage: bool
    n: int = 1
    cache_salt: str | None = None


def _decode(body: bytes, kind: type[R]) -> R:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        unknown = re.match(r"Object contains unknown field `([^`]*)`", msg)
        if unknown:
            name = unknown.group(1)[:64]
            raise UnsupportedParameterError(f"unrecognized request argument: {name!r}", param=name) from None
        at = re.search(r" - at `\$\.?([^`]*)`$", msg)
        raise InvalidRequestError(msg, param=(at.group(1) or None) if at else None) from None
    except msgspec.DecodeError as e:
        raise InvalidJSONError(f"request body is not valid JSON: {e}") from None


def _common(req: _Request, limits: Limits, max_tokens: int | None, max_param: str, logprobs: int | None
            ) -> dict[str, Any]:
    for name, neutral in NEUTRAL.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in neutral):  # True is not 1 here
            raise UnsupportedParameterError(f"{name!r} is not supported by DroidMesh (only {neutral[1]!r})", param=name)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
    tokens = limits.default_max_tokens if max_tokens is None else max_tokens
    if tokens > limits.max_tokens_limit:
        raise InvalidRequestError(f"{max_param} {tokens} exceeds this gateway's limit {limits.max_tokens_limit}",
                                  param=max_param)
    n = req.n or 1
    if n > 1 and req.stream:
        raise UnsupportedParameterError("n > 1 with stream: true is not supported by DroidMesh yet; ask without "
                                        "streaming", param="n")
    if logprobs is not None and req.stream:
        raise UnsupportedParameterError("logprobs with stream: true is not supported by DroidMesh yet; ask without "
                                        "streaming", param="logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # OpenAI's defaults (temperature 1, top_p 1) when a field is absent; temperature 0 is greedy.
    sampling = Sampling(temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop,
                        logprobs=logprobs)
    return dict(model=req.model, sampling=sampling, max_new_tokens=tokens, stream=req.stream,
                include_usage=bool(req.stream_options and req.stream_options.include_usage), n=n,
                cache_salt=req.cache_salt)


def salted_scope(scope: str, salt: str | None) -> str:
    """The scope of a request with `cache_salt` `salt`: `<scope>.<hash>` under a tenant's scope
    (a receiver still reads it as that tenant's: never another's, whatever the salt), `salt:<hash>`
    without keys (`public`), the hash of the scope and the salt; `scope` itself without a salt."""
    if salt is None:
        return scope
    salted = b"droidmesh-cache-salt\0" + scope.encode() + b"\0" + salt.encode("utf-8", "surrogatepass")
    mark = hashlib.sha256(salted).hexdigest()[:SALT_HEX]
    return check_scope(f"salt:{mark}" if scope == PUBLIC else f"{scope}.{mark}")


def _fits_bus(call: MeshCall) -> MeshCall:
    """`call` as the bus will carry it (a GenerateRequest) must encode within one message: a value
    that passed every check above but not msgpack is a 400 now, never a 500 from the mesh client."""
    probe = GenerateRequest(request_id="", context=call.context, question=call.question,
                            max_new_tokens=call.max_new_tokens, sampling=call.sampling, chat=call.chat)
    try:
        size = len(schemas.encode(probe))
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
        raise InvalidRequestError(f"a request field cannot be carried to the mesh: {str(e).splitlines()[0][:200]}") from None
    if size > schemas.MAX_MESSAGE_BYTES - BUS_ENVELOPE_BYTES:
        raise BodyTooLargeError(f"the request is {size} bytes on the bus, over its {schemas.MAX_MESSAGE_BYTES}-byte messages")
    return call


BUS_ENVELOPE_BYTES = 1024  # what the mesh client adds to the probe (request id, deadline, stream inbox)


def parse_completion(body: bytes, limits: Limits) -> MeshCall:
    """POST /v1/completions: the prompt is sent as the context (question empty)."""
    req = _decode(body, CompletionRequest)
    return _fits_bus(MeshCall(kind="completion", context=req.prompt, question="", chat=None,
                              **_common(req, limits, req.max_tokens, "max_tokens", req.logprobs)))


def parse_chat(body: bytes, limits: Limits) -> MeshCall:
    """POST /v1/chat/completions: the messages go as `chat` (OpenAI's `developer` role is `system`)."""
    req = _decode(body, ChatRequest)
    chat = [schemas.ChatMessage(role="system" if m.role == "developer" else m.role,
                                content=m.content if isinstance(m.content, str) else "".join(p.text for p in m.content))
            for m in req.messages]
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _fits_bus(MeshCall(kind="chat", context="", question="", chat=chat,
                              **_common(req, limits, limit, param, logprobs)))
