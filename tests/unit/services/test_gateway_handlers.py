"""The gateway's HTTP API against an in-process fake mesh: routes, streaming, errors, ids, limits, lifecycle."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.handlers import make_app
from droidmesh.services.gateway.service import GatewayService
from droidmesh.services.gateway.state import GatewayState
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.mesh import discovery
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.client import MeshError
from droidmesh.shared.service import settings
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateChunk
from tests.unit.services.test_gateway_openai import NoRespondersError, reply

CHAT = {"model": "qa", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


class FakeMesh:
    """MeshClient's gateway-facing methods: canned answers, recorded calls, injectable failures."""

    def __init__(self, models: tuple[str, ...] = ("qa",), pieces: tuple[str, ...] = ("hel", "lo", " world"),
                 fail: BaseException | None = None, fail_after: int | None = None, endless: bool = False):
        self.models, self.pieces, self.fail, self.fail_after, self.endless = list(models), pieces, fail, fail_after, endless
        self.calls: list[dict[str, Any]] = []
        self.discoveries = 0
        self.closed = asyncio.Event()

    async def ask(self, receiver: str, context: str, question: str, **kw: Any) -> schemas.GenerateReply:
        self.calls.append(dict(receiver=receiver, context=context, question=question, **kw))
        if self.fail is not None:
            raise self.fail
        return reply(text="".join(self.pieces), request_id=kw["request_id"])

    async def stream(self, receiver: str, context: str, question: str, **kw: Any
                     ) -> AsyncIterator[GenerateChunk | schemas.GenerateReply]:
        self.calls.append(dict(receiver=receiver, context=context, question=question, **kw))
        try:
            i = 0
            while True:
                if self.fail is not None and i == (self.fail_after or 0):
                    raise self.fail
                if i == len(self.pieces) and not self.endless:
                    break
                yield GenerateChunk(request_id=kw["request_id"], index=i, text=self.pieces[i % len(self.pieces)],
                                    token_ids=[i])
                i += 1
            yield reply(text="".join(self.pieces), request_id=kw["request_id"])
        finally:
            self.closed.set()

    async def receivers(self, window_s: float = 0.5) -> list[discovery.ReceiverModel]:
        self.discoveries += 1
        return [discovery.ReceiverModel(m, ("i1", "i2"), "0.1.0") for m in self.models]


def _state(mesh: FakeMesh, mesh_up: Callable[[], bool] = lambda: True, **cfg: Any) -> GatewayState:
    return GatewayState(GatewayConfig(**{"max_tokens_limit": 64, **cfg}), mesh, Metrics("gateway"), mesh_up=mesh_up)


def serve(state: GatewayState, fn: Callable[[TestClient], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        async with TestClient(TestServer(make_app(state))) as client:
            return await fn(client)

    return asyncio.run(run())


def sse_data(text: str) -> list[str]:
    return [f.removeprefix("data: ") for f in text.split("\n\n") if f]


def test_models_list_is_openai_shaped_and_cached():
    """GET /v1/models lists the discovered receiver models, and a second call reuses the discovery."""
    mesh = FakeMesh(models=("qa", "code"))

    async def go(c: TestClient) -> list[Any]:
        first = await (await c.get("/v1/models")).json()
        second = await c.get("/v1/models/qa")
        return [first, second.status, await second.json()]

    first, status, one = serve(_state(mesh), go)
    assert first["object"] == "list" and [m["id"] for m in first["data"]] == ["qa", "code"]
    assert {m["object"] for m in first["data"]} == {"model"} and first["data"][0]["droidmesh"] == {"instances": 2}
    assert status == 200 and one["id"] == "qa" and mesh.discoveries == 1


def test_completion_sends_the_prompt_as_context_with_a_fresh_mesh_id():
    """A completion reaches the mesh as context=prompt, question=""; the client's x-request-id is echoed
    but the mesh gets its own id (receivers answer repeated ids from a cache)."""
    mesh = FakeMesh()

    async def go(c: TestClient) -> tuple[Any, Any]:
        r = await c.post("/v1/completions", json={"model": "qa", "prompt": "doc", "max_tokens": 4},
                         headers={"x-request-id": "client-1"})
        return r.headers["x-request-id"], await r.json()

    rid, out = serve(_state(mesh), go)
    (call,) = mesh.calls
    assert rid == "client-1" and call["request_id"] != "client-1" and out["id"] == f"cmpl-{call['request_id']}"
    assert (call["context"], call["question"], call["chat"], call["max_new_tokens"]) == ("doc", "", None, 4)
    assert out["choices"][0]["text"] == "hello world" and out["usage"]["total_tokens"] == 13
    assert out["droidmesh"]["path"] == "partial"


def test_chat_stream_deltas_make_the_text():
    """A streamed chat is SSE: deltas concatenate to the text, the finish chunk has the extension, then [DONE]."""
    mesh = FakeMesh()

    async def go(c: TestClient) -> tuple[str, str]:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
        return r.headers["Content-Type"], await r.text()

    ctype, text = serve(_state(mesh), go)
    assert ctype.startswith("text/event-stream")
    data = sse_data(text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["droidmesh"]["served_by"] == "qa-1"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert mesh.calls[0]["chat"] == [schemas.ChatMessage("user", "hi")] and mesh.closed.is_set()


@pytest.mark.parametrize("fail,status,code", [
    (MeshError(schemas.ErrorReply(code="bad_request", message="empty prompt")), 400, "bad_request"),
    (MeshError(schemas.ErrorReply(code="deadline_exceeded", message="late")), 504, "deadline_exceeded"),
    (MeshError(schemas.ErrorReply(code="internal", message="secret")), 500, "internal"),
    (TimeoutError("slow"), 504, "deadline_exceeded"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_mesh_failures_map_to_http(fail, status, code, stream):
    """Mesh errors (before any streamed byte) are HTTP errors in OpenAI shape with fitting statuses."""
    async def go(c: TestClient) -> tuple[int, Any]:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        return r.status, await r.json()

    got, body = serve(_state(FakeMesh(fail=fail)), go)
    assert got == status and body["error"]["code"] == code


def test_no_responders_and_nats_down_are_503():
    """No receiver answering a known model, and a disconnected bus, are both 503."""
    try:
        raise TimeoutError("no reply") from NoRespondersError()
    except TimeoutError as e:
        no_responders = e

    async def go(c: TestClient) -> int:
        return (await c.post("/v1/chat/completions", json=CHAT)).status

    assert serve(_state(FakeMesh(fail=no_responders)), go) == 503
    assert serve(_state(FakeMesh(), mesh_up=lambda: False), go) == 503


def test_unknown_model_is_404_and_a_vanished_one_503():
    """A model never discovered is 404 model_not_found; one seen before with no receiver up now is 503."""
    mesh = FakeMesh()
    state = _state(mesh, models_ttl_s=1e-9, models_keep_s=1e-9)  # every request discovers afresh, keeps nothing

    async def go(c: TestClient) -> list[tuple[int, Any]]:
        out = []
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        out.append((r.status, (await r.json())["error"]))
        mesh.models = []
        r = await c.post("/v1/chat/completions", json=CHAT)
        out.append((r.status, (await r.json())["error"]))
        return out

    (s1, e1), (s2, e2) = serve(state, go)
    assert (s1, e1["code"], e1["param"]) == (404, "model_not_found", "model")
    assert (s2, e2["code"]) == (503, "service_unavailable")


def test_limits_and_bad_requests():
    """Bodies over the limit are 413, max_tokens over the limit and bad headers 400, unknown routes 404, all OpenAI-shaped."""
    async def go(c: TestClient) -> list[tuple[int, str]]:
        out = []
        for r in [await c.post("/v1/completions", data=b"x" * 2048, headers={"Content-Type": "application/json"}),
                  await c.post("/v1/completions", json={"model": "qa", "prompt": "p", "max_tokens": 65}),
                  await c.post("/v1/completions", json={"model": "qa", "prompt": "p"}, headers={"x-request-timeout": "-1"}),
                  await c.post("/v1/completions", data=b"{nope", headers={"Content-Type": "application/json"}),
                  await c.get("/v1/nothing"),
                  await c.get("/v1/completions")]:
            out.append((r.status, (await r.json())["error"]["code"]))
        return out

    assert serve(_state(FakeMesh(), max_body_bytes=1024), go) == [
        (413, "request_too_large"), (400, "invalid_value"), (400, "invalid_value"), (400, "invalid_json"),
        (404, "not_found"), (405, "method_not_allowed")]


def test_chunked_body_over_the_limit_is_413():
    """A body without Content-Length is still cut at the limit."""
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"x" * 512

    async def go(c: TestClient) -> int:
        return (await c.post("/v1/completions", data=chunks(), headers={"Content-Type": "application/json"})).status

    assert serve(_state(FakeMesh(), max_body_bytes=1024), go) == 413


def test_timeout_header_lowers_the_deadline_only():
    """x-request-timeout lowers the mesh call's timeout; it never raises it above the configured one."""
    mesh = FakeMesh()

    async def go(c: TestClient) -> None:
        for value in ("2.5", "999"):
            await c.post("/v1/completions", json={"model": "qa", "prompt": "p"}, headers={"x-request-timeout": value})

    serve(_state(mesh, request_timeout_s=30.0), go)
    assert [c["timeout"] for c in mesh.calls] == [2.5, 30.0]


def test_error_mid_stream_is_an_error_event():
    """A mesh failure after the first chunk ends the stream with an OpenAI error event and no [DONE]."""
    mesh = FakeMesh(fail=MeshError(schemas.ErrorReply(code="internal", message="x")), fail_after=1)

    async def go(c: TestClient) -> tuple[int, str]:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        return r.status, await r.text()

    status, text = serve(_state(mesh), go)
    data = sse_data(text)
    assert status == 200 and "[DONE]" not in data and json.loads(data[-1])["error"]["code"] == "internal"


def test_client_disconnect_ends_only_its_stream():
    """A client leaving mid-stream closes that request's mesh stream; the gateway keeps serving others."""
    endless = FakeMesh(endless=True)
    state = _state(endless)

    async def go(c: TestClient) -> int:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await r.content.readuntil(b"\n\n")  # the stream is flowing
        r.close()  # drop the connection
        await asyncio.wait_for(endless.closed.wait(), 30)
        state.client = FakeMesh()
        return (await c.post("/v1/chat/completions", json=CHAT)).status

    assert serve(state, go) == 200
    assert state.metrics.gateway_inflight._value.get() == 0


def test_insane_request_ids_are_replaced():
    """An x-request-id that is too long or has odd characters is replaced by a generated one."""
    async def go(c: TestClient) -> list[str]:
        return [(await c.get("/v1/models", headers={"x-request-id": v})).headers["x-request-id"]
                for v in ("ok-id_1", "bad id\tx", "x" * 100)]

    ok, bad, long = serve(_state(FakeMesh()), go)
    assert ok == "ok-id_1" and bad != "bad id\tx" and long != "x" * 100 and len(bad) == 16


def test_requests_are_counted():
    """Each request moves the gateway's request counter by route and status."""
    state = _state(FakeMesh())

    async def go(c: TestClient) -> None:
        await c.post("/v1/chat/completions", json=CHAT)
        await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})

    serve(state, go)
    text = state.metrics.render().decode()
    assert 'dm_gateway_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'dm_gateway_requests_total{route="/v1/chat/completions",status="404"} 1.0' in text
    assert 'dm_gateway_tokens_total{kind="reused"} 8.0' in text


def test_service_listens_on_an_ephemeral_port_and_stops():
    """The service binds port 0 to a free port, answers there, and stops listening when it stops."""
    async def run() -> tuple[int, int]:
        svc = GatewayService(GatewayConfig(http_port=0), bus=InProcessBus(), client=FakeMesh())
        async with svc:
            assert svc.http_port
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{svc.http_port}/v1/models") as r:
                status = r.status
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{svc.http_port}/v1/models"):
                pass
        return status, svc.http_port

    status, _ = asyncio.run(run())
    assert status == 200


def test_gateway_imports_no_torch():
    """The gateway process never imports torch (it holds no model)."""
    code = "import sys, droidmesh.services.gateway.service; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("argv,match", [
    (["--http-port", "70000"], "http_port"),
    (["--max-body-bytes", str(1 << 21)], "max_body_bytes"),
    (["--default-max-tokens", "100", "--max-tokens-limit", "50"], "default_max_tokens"),
    (["--request-timeout-s", "0"], "request_timeout_s"),
])
def test_bad_config_values_raise(argv, match):
    """Each bad gateway setting raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=match):
        settings.load(GatewayConfig, "gateway", argv, {})


def test_config_flags_and_env():
    """Gateway settings load from flags and DM_GATEWAY_* env with documented defaults."""
    cfg = settings.load(GatewayConfig, "gateway", ["--http-port", "0"], {"DM_GATEWAY_MAX_TOKENS_LIMIT": "256"})
    assert (cfg.http_host, cfg.http_port, cfg.max_tokens_limit, cfg.default_max_tokens) == ("127.0.0.1", 0, 256, 16)
