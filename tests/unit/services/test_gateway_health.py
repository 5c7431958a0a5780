"""The gateway's `GET /health` on its API port: 200 with the models while the mesh is connected,
503 before, no key needed (and then no model names), discovery shared with /v1/models."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp.test_utils import TestClient

from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.state import GatewayState
from droidmesh.shared.service.metrics import Metrics
from tests.unit.services.test_gateway_handlers import FakeMesh, serve
from tests.unit.services.test_gateway_keys import bearer, keyed


def test_health_lists_the_models_and_shares_the_discovery_with_models():
    mesh = FakeMesh(models=("qa", "code"))
    state = GatewayState(GatewayConfig(), mesh, Metrics("gateway"))

    async def go(c: TestClient) -> list[Any]:
        r = await c.get("/health")
        body = (r.status, await r.json())
        listed = await (await c.get("/v1/models")).json()
        head = await c.head("/health")
        return [body, [m["id"] for m in listed["data"]], head.status]

    (status, body), listed, head = serve(state, go)
    assert status == 200 and body == {"status": "ok", "models": ["code", "qa"]}
    assert sorted(listed) == body["models"] and head == 200
    assert mesh.discoveries == 1  # one discovery answered all three


def test_health_is_503_until_the_mesh_is_connected():
    mesh = FakeMesh()
    up = [False]
    state = GatewayState(GatewayConfig(), mesh, Metrics("gateway"), mesh_up=lambda: up[0])

    async def go(c: TestClient) -> list[tuple[int, Any]]:
        out = []
        for connected in (False, True):
            up[0] = connected
            r = await c.get("/health")
            out.append((r.status, await r.json()))
        return out

    (down, down_body), (ok, ok_body) = serve(state, go)
    assert down == 503 and down_body["status"] == "unavailable" and "models" not in down_body
    assert ok == 200 and ok_body["models"] == ["qa"]


def test_health_needs_no_key_and_names_no_model_with_a_key_file():
    """With a key file /health answers without a key, and says nothing of which models exist; every
    other route still needs one."""
    mesh = FakeMesh(models=("qa", "secret"))
    state, key, _ = keyed(mesh)

    async def go(c: TestClient) -> list[tuple[int, Any]]:
        out = []
        for headers in ({}, bearer(key)):
            r = await c.get("/health", headers=headers)
            out.append((r.status, await r.json()))
        r = await c.get("/v1/models")
        out.append((r.status, await r.json()))
        return out

    (anon, anon_body), (keyed_status, keyed_body), (models, _) = serve(state, go)
    assert anon == 200 and anon_body == {"status": "ok"}
    assert keyed_status == 200 and keyed_body == {"status": "ok"}
    assert models == 401


def test_a_model_the_cached_discovery_missed_gets_one_fresh_discovery_not_a_404():
    """A receiver busy when the gateway last asked (its answer missed the window) is not gone: a
    request naming its model triggers one fresh discovery, which finds it; a model nobody serves is
    a 404 after that one discovery, not a stream of them."""
    import asyncio

    from droidmesh.services.gateway import openai

    mesh = FakeMesh(models=("code",))  # qa's receiver did not answer the first discovery
    state = GatewayState(GatewayConfig(discovery_window_s=1e-9), mesh, Metrics("gateway"))  # any earlier one is stale

    async def go() -> tuple[int, int]:
        await state.models()
        mesh.models.append("qa")  # it answers the next one
        await state.check_model("qa")
        found = mesh.discoveries
        try:
            await state.check_model("nobody")
        except openai.ModelNotFoundError:
            return found, mesh.discoveries
        raise AssertionError("no 404")

    assert asyncio.run(go()) == (2, 3)


def test_a_model_a_busy_receiver_left_out_of_one_discovery_stays_listed():
    """A discovery that misses a model found a moment ago (its receiver too busy to answer within
    the window) keeps it listed, as last found, for `models_keep_s`; past that it is gone."""
    import asyncio

    mesh = FakeMesh(models=("qa", "code"))
    state = GatewayState(GatewayConfig(models_ttl_s=1e-9, models_keep_s=30.0), mesh, Metrics("gateway"))

    async def go() -> list[list[str]]:
        seen = [[m.model_id for m in await state.models()]]
        mesh.models.remove("qa")
        seen.append([m.model_id for m in await state.models()])
        state.cfg = dataclasses.replace(state.cfg, models_keep_s=1e-9)
        seen.append([m.model_id for m in await state.models()])
        return seen

    assert asyncio.run(go()) == [["qa", "code"], ["code", "qa"], ["code"]]
