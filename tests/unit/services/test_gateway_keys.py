"""The gateway with a key file, against a fake mesh and a pinned clock: 401 / 403 / 429 in OpenAI's
shape, Retry-After, the key's models, its id (never the key) in the log line and the metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient

from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.state import GatewayState
from droidmesh.shared.auth import keys
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service.metrics import Metrics
from tests.unit.auth.test_quota import Clock
from tests.unit.services.test_gateway_handlers import CHAT, FakeMesh, serve

COMPLETION = {"model": "qa", "prompt": "doc", "max_tokens": 4}


def keyed(mesh: FakeMesh, **limits: Any) -> tuple[GatewayState, str, Clock]:
    key, kid = keys.make_key()
    entry = keys.ApiKey(**{"id": kid, "digest": keys.digest(key), "tenant": "acme", "models": ("qa",),
                           "requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 4, **limits})
    clock = Clock()
    state = GatewayState(GatewayConfig(max_tokens_limit=64), mesh, Metrics("gateway"), keys=keys.KeyRing({kid: entry}),
                         clock=clock)
    return state, key, clock


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_key_and_a_wrong_key_are_401_in_openai_shape():
    mesh = FakeMesh()
    state, key, _ = keyed(mesh)
    other, _ = keys.make_key()

    async def go(c: TestClient) -> list[tuple[int, Any]]:
        out = []
        for headers in ({}, bearer(other), {"Authorization": key}):  # the last: no Bearer scheme
            r = await c.post("/v1/completions", json=COMPLETION, headers=headers)
            out.append((r.status, await r.json()))
        r = await c.get("/v1/models")
        out.append((r.status, await r.json()))
        return out

    for status, body in serve(state, go):
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert mesh.calls == [] and mesh.discoveries == 0  # refused before the mesh is asked anything


def test_a_model_the_key_may_not_use_is_403_whether_or_not_it_exists():
    mesh = FakeMesh(models=("qa", "code"))
    state, key, _ = keyed(mesh)

    async def go(c: TestClient) -> list[Any]:
        out = []
        for model in ("code", "nosuch"):
            r = await c.post("/v1/completions", json={**COMPLETION, "model": model}, headers=bearer(key))
            out.append((r.status, (await r.json())["error"]))
        r = await c.get("/v1/models/code", headers=bearer(key))
        out.append((r.status, (await r.json())["error"]))
        listed = await (await c.get("/v1/models", headers=bearer(key))).json()
        return out + [[m["id"] for m in listed["data"]]]

    *refused, listed = serve(state, go)
    for status, err in refused:
        assert status == 403 and err["code"] == "permission_denied" and err["param"] == "model"
    assert listed == ["qa"] and mesh.calls == []


def test_over_the_request_rate_is_429_with_retry_after():
    state, key, clock = keyed(FakeMesh(), requests_per_minute=2)

    async def go(c: TestClient) -> list[tuple[int, str | None]]:
        out = []
        for advance in (0, 0, 0, 30):
            clock.now += advance
            r = await c.post("/v1/completions", json=COMPLETION, headers=bearer(key))
            out.append((r.status, r.headers.get("Retry-After")))
        return out

    assert serve(state, go) == [(200, None), (200, None), (429, "30"), (200, None)]


def test_over_the_token_budget_is_429_and_a_failed_request_costs_nothing():
    """Each answer uses 13 tokens (10 prompt, 3 completion): a budget of 25 a minute admits two
    (the second overdraws it to -1), the third waits until it is above zero again."""
    mesh = FakeMesh()
    state, key, clock = keyed(mesh, tokens_per_minute=25)

    async def go(c: TestClient) -> list[tuple[int, str | None, str]]:
        out = []
        for _ in range(3):
            r = await c.post("/v1/completions", json=COMPLETION, headers=bearer(key))
            body = await r.json()
            out.append((r.status, r.headers.get("Retry-After"), body.get("error", {}).get("code", "")))
        return out

    (a, b, c) = serve(state, go)
    assert a[0] == b[0] == 200 and c == (429, "5", "rate_limit_exceeded")  # 2 tokens at 25/60 a second: 4.8 s
    clock.now += 60
    mesh.fail = RuntimeError("boom")
    statuses = serve(state, lambda cl: _statuses(cl, key, 7))
    assert statuses == [500] * 7  # each reservation came back: without that the 7th would find 1 token left


async def _statuses(c: TestClient, key: str, n: int) -> list[int]:
    return [(await c.post("/v1/completions", json=COMPLETION, headers=bearer(key))).status for _ in range(n)]


def test_the_log_line_and_metrics_name_the_key_id_never_the_key():
    state, key, _ = keyed(FakeMesh())
    kid = next(iter(state.keys.keys))  # type: ignore[union-attr]
    with structlog.testing.capture_logs() as logs:
        assert serve(state, lambda c: _statuses(c, key, 1)) == [200]
    (line,) = [r for r in logs if r["event"] == "request"]
    assert line["key_id"] == kid and line["tenant"] == "acme" and key not in repr(logs)
    text = state.metrics.render().decode()
    assert f'dm_gateway_key_requests_total{{key_id="{kid}",status="200"}} 1.0' in text
    assert f'dm_gateway_key_tokens_total{{key_id="{kid}",kind="prompt"}} 10.0' in text and key not in text


def test_without_a_key_file_only_loopback_may_be_bound(tmp_path):
    with pytest.raises(ConfigError, match="without API keys"):
        GatewayConfig(http_host="0.0.0.0")
    for host in ("127.0.0.1", "::1", "localhost"):
        GatewayConfig(http_host=host)
    with pytest.raises(ConfigError, match="key file"):
        GatewayConfig(http_host="0.0.0.0", api_keys=str(tmp_path / "keys.toml"))  # named, but not there
    key, kid = keys.make_key()
    keys.append(tmp_path / "keys.toml", keys.ApiKey(id=kid, digest=keys.digest(key), tenant="a", models=("*",),
                                                    requests_per_minute=1, tokens_per_minute=1, max_concurrent=1))
    GatewayConfig(http_host="0.0.0.0", api_keys=str(tmp_path / "keys.toml"))


def test_leaving_a_stream_midway_still_spends_the_reservation():
    """A client that drops a stream after its first tokens is charged its max_tokens (else leaving
    early would make every answer free); the next 16-token request finds only 4 of 20 left."""
    endless = FakeMesh(endless=True)
    state, key, _ = keyed(endless, tokens_per_minute=20)
    entry = next(iter(state.keys.keys.values()))  # type: ignore[union-attr]

    async def go(c: TestClient) -> int:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 16}, headers=bearer(key))
        await r.content.readuntil(b"\n\n")  # the stream is flowing
        r.close()
        await asyncio.wait_for(endless.closed.wait(), 30)
        for _ in range(1000):  # until the middleware has settled the request
            if state.quotas.inflight(entry) == 0:
                break
            await asyncio.sleep(0.005)
        state.client = FakeMesh()
        return (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 16}, headers=bearer(key))).status

    assert serve(state, go) == 429
