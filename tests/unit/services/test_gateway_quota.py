"""The gateway with shared limits, a key file that changes, and `cache_salt`, against a fake mesh
and pinned clocks: two gateway states over one quota store hold a key's limit between them; a
reloaded file's removed key is 401 from the next request; a salted request's scope is a sub-scope
of its tenant's, which the receiver still binds to that tenant alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from droidmesh.services.gateway import openai as oa
from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.handlers import make_app
from droidmesh.services.gateway.state import GatewayState
from droidmesh.shared.auth import keys
from droidmesh.shared.auth.shared_quota import MemoryQuotaStore
from droidmesh.shared.errors import BadRequestError, ConfigError
from droidmesh.shared.mesh.caller import request_scope
from droidmesh.shared.mesh.nats_auth import tenant_user
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire.hashing import MAX_SCOPE_CHARS, PUBLIC, check_scope, tenant_scope
from droidmesh.shared.wire.subjects import model_token
from tests.unit.auth.test_key_file import fresh, write
from tests.unit.auth.test_quota import Clock
from tests.unit.services.test_gateway_handlers import FakeMesh, serve
from tests.unit.services.test_gateway_keys import COMPLETION, bearer, keyed

LIMITS = oa.Limits(default_max_tokens=16, max_tokens_limit=64)


def test_two_gateways_sharing_the_quota_store_hold_a_keys_limit_between_them():
    """A key of 10 requests a minute, asked alternately of two gateways: 10 answered in all (each
    gateway alone would answer 10), the rest 429 with Retry-After."""
    store = MemoryQuotaStore()
    made, key, clock = keyed(FakeMesh(), requests_per_minute=10)
    a, b = (GatewayState(made.cfg, FakeMesh(), Metrics("gateway"), keys=made.keys, clock=clock, wall=lambda: 1e9)
            for _ in range(2))
    for state in (a, b):
        state.quotas.attach(store)

    async def go() -> list[int]:
        async with TestClient(TestServer(make_app(a))) as ca, TestClient(TestServer(make_app(b))) as cb:
            out = []
            for _ in range(10):
                for c in (ca, cb):
                    r = await c.post("/v1/completions", json=COMPLETION, headers=bearer(key))
                    out.append(r.status)
                    assert r.status == 200 or r.headers["Retry-After"]
            return out

    statuses = asyncio.run(go())
    assert statuses.count(200) == 10 and statuses.count(429) == 10
    assert set(statuses[:10]) == {200}  # alternating: both gateways answered until the key's 10 were spent


def _keyed_file(tmp_path: Path) -> tuple[GatewayState, Path, dict[str, tuple[str, keys.ApiKey]]]:
    path = tmp_path / "keys.toml"
    made = {"a": fresh(), "b": fresh("beta")}
    write(path, [made["a"][1], made["b"][1]])
    state = GatewayState(GatewayConfig(api_keys=str(path), max_tokens_limit=64), FakeMesh(), Metrics("gateway"),
                         clock=Clock())
    return state, path, made


def test_a_removed_key_is_refused_from_the_next_request_and_a_bad_file_keeps_the_keys(tmp_path):
    state, path, made = _keyed_file(tmp_path)
    (ka, a), (kb, _) = made["a"], made["b"]
    kc, c = fresh("gamma")

    async def go(cl: TestClient) -> list[tuple[str, int]]:
        async def status(name: str, key: str) -> tuple[str, int]:
            return name, (await cl.post("/v1/completions", json=COMPLETION, headers=bearer(key))).status

        out = [await status("a", ka), await status("b", kb)]
        write(path, [a, c])  # b revoked, c added
        assert state.reload_keys()
        out += [await status("a", ka), await status("b", kb), await status("c", kc)]
        write(path, [a], extra="[[key]]\n")  # a bad edit: a, c stay
        assert not state.reload_keys()
        out += [await status("c", kc)]
        return out

    assert serve(state, go) == [("a", 200), ("b", 200), ("a", 200), ("b", 401), ("c", 200), ("c", 200)]


def test_the_gateway_checks_its_quota_and_key_settings():
    for bad in ({"quota_lease_fraction": 0}, {"quota_lease_fraction": 1.5}, {"quota_lease_s": 0},
                {"quota_timeout_s": float("nan")}, {"keys_reload_s": -1}):
        with pytest.raises(ConfigError):
            GatewayConfig(**bad)  # type: ignore[arg-type]
    GatewayConfig(keys_reload_s=0, quota_lease_fraction=1.0)


# -- cache_salt ----------------------------------------------------------------------------------
def test_cache_salt_is_parsed_as_vllm_takes_it():
    chat = {"model": "qa", "messages": [{"role": "user", "content": "hi"}]}
    assert oa.parse_completion(json.dumps({"model": "qa", "prompt": "p", "cache_salt": "s1"}).encode(),
                               LIMITS).cache_salt == "s1"
    assert oa.parse_chat(json.dumps({**chat, "cache_salt": "s1"}).encode(), LIMITS).cache_salt == "s1"
    assert oa.parse_chat(json.dumps(chat).encode(), LIMITS).cache_salt is None
    for bad in ("", 7, ["s"], "x" * (oa.MAX_SALT_CHARS + 1)):
        with pytest.raises(oa.InvalidRequestError) as e:
            oa.parse_chat(json.dumps({**chat, "cache_salt": bad}).encode(), LIMITS)
        assert e.value.param == "cache_salt"


def test_a_salt_narrows_a_tenants_scope_and_never_reaches_another_tenants():
    secret = bytes(range(32))
    acme, beta = tenant_scope("acme", secret), tenant_scope("beta", secret)
    s1, s1_again, s2 = oa.salted_scope(acme, "s1"), oa.salted_scope(acme, "s1"), oa.salted_scope(acme, "s2")
    assert s1 == s1_again != s2 and s1.startswith(acme + ".") and oa.salted_scope(acme, None) == acme
    assert oa.salted_scope(beta, "s1") != s1  # the same salt in two tenants: two scopes
    assert oa.salted_scope(PUBLIC, "s1").startswith("salt:")  # without keys
    longest = tenant_scope("t" * 64, secret)
    assert len(oa.salted_scope(longest, "s" * 1024)) <= MAX_SCOPE_CHARS and check_scope(oa.salted_scope(longest, "x"))
    # the receiver binds the salted scope to the tenant as it does the tenant's own
    assert request_scope(s1, model_token(tenant_user("acme")), False) == s1
    with pytest.raises(BadRequestError):
        request_scope(s1, model_token(tenant_user("beta")), False)


def test_a_salted_request_reaches_the_mesh_in_its_sub_scope():
    mesh = FakeMesh()
    state, key, _ = keyed(mesh)
    entry = next(iter(state.keys.keys.values()))  # type: ignore[union-attr]

    async def go(c: TestClient) -> list[int]:
        out = []
        for extra in ({}, {"cache_salt": "s1"}, {"cache_salt": "s1"}, {"cache_salt": "s2"}):
            r = await c.post("/v1/completions", json={**COMPLETION, **extra}, headers=bearer(key))
            out.append(r.status)
        return out

    assert serve(state, go) == [200] * 4
    scopes: list[Any] = [call["scope"] for call in mesh.calls]
    base = entry.scope or tenant_scope(entry.tenant)
    assert scopes[0] == base and scopes[1] == scopes[2] == oa.salted_scope(base, "s1") != scopes[3]
