"""Tenants over a real mesh (nats-server, broker, sender, receiver, gateway with a key file made by
`droidmesh keys add`): who may use the gateway (401 / 403 / 429) and whose cache a request may
reuse (its tenant's own and public contexts, never another tenant's)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.launch import Proc, start_nats
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.wire.hashing import PUBLIC, tenant_scope
from tests.system.conftest import start_together, stop_together, words

pytestmark = pytest.mark.system

THREADS = {"OMP_NUM_THREADS": "1"}
QUESTION = " what is gamma"
TENANT_CONTEXT = words(400, offset=11)  # tenant A's document, cached in A's scope only
PUBLIC_CONTEXT = words(400, offset=23)  # a shared corpus the operator publishes to every tenant


class Mesh:
    def __init__(self, url: str, gateway: Proc, keys: dict[str, str], tmp: Path):
        self.url, self.gateway, self.keys, self.tmp = url, gateway, keys, tmp
        self.base = f"http://127.0.0.1:{gateway.events('gateway_started')[0]['http_port']}/v1"

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=self.keys[name], max_retries=0, timeout=120)


def _add_key(path: Path, tenant: str, models: str, *extra: str) -> str:
    out = CliRunner().invoke(main, ["keys", "add", "--file", str(path), "--tenant", tenant, "--models", models, *extra])
    assert out.exit_code == 0, out.output
    return out.stdout.strip()


@pytest.fixture(scope="module")
def mesh(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("tenants")
    path = tmp / "keys.toml"
    keys = {"a": _add_key(path, "A", "qa"), "b": _add_key(path, "B", "qa"), "code": _add_key(path, "C", "code"),
            "slow": _add_key(path, "D", "qa", "--rpm", "2"), "thrifty": _add_key(path, "E", "qa", "--tpm", "40")}
    nats, url = start_nats(store_dir=str(tmp / "js"))
    procs: list[Proc] = []
    try:
        *_, gateway = start_together(url, [
            ("cache_broker", {}, {"env": THREADS}),
            ("sender", {"model_path": tiny_pair[0], "model_id": "summ", "e_layers": [1]}, {"env": THREADS}),
            # hold off: the tests' prompts repeat, and each asks for the sender's scoped cache
            ("receiver", {"model_path": tiny_pair[1], "model_id": "qa", "default_group": [1, 2], "hold": False},
             {"env": THREADS}),
            ("gateway", {"http_port": 0, "api_keys": path, "max_tokens_limit": 64}, {}),  # discovers receivers per request
        ], procs)
        yield Mesh(url, gateway, keys, tmp)
    finally:
        stop_together(procs)
        nats.stop()


def test_without_a_key_file_the_gateway_refuses_to_listen_beyond_loopback():
    """One line saying why, exit status 2, before touching the network."""
    out = subprocess.run([sys.executable, "-m", "droidmesh.services.gateway", "--nats-url", "nats://127.0.0.1:1",
                          "--http-host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "without API keys" in out.stderr


def _post(base: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, dict[str, str]]:
    req = urllib.request.Request(f"{base}/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_no_key_and_a_wrong_key_are_401(mesh):
    status, body, _ = _post(mesh.base, {"model": "qa", "prompt": "hello", "max_tokens": 2}, {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    wrong = mesh.keys["a"][:-6] + ("AAAAAA" if not mesh.keys["a"].endswith("AAAAAA") else "BBBBBB")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=mesh.base, api_key=wrong, max_retries=0).models.list()
    assert e.value.status_code == 401


def test_a_key_for_another_model_is_403(mesh):
    with pytest.raises(openai.PermissionDeniedError) as e:
        mesh.client("code").completions.create(model="qa", prompt="hello", max_tokens=2)
    assert e.value.status_code == 403 and e.value.body["code"] == "permission_denied"  # type: ignore[index]
    assert [m.id for m in mesh.client("a").models.list()] == ["qa"]
    assert [m.id for m in mesh.client("code").models.list()] == []


def test_over_the_request_rate_is_429_with_retry_after(mesh):
    client = mesh.client("slow")
    for _ in range(2):
        client.completions.create(model="qa", prompt="hello", max_tokens=2, temperature=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="qa", prompt="hello", max_tokens=2, temperature=0)
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_over_the_token_budget_is_429_with_retry_after(mesh):
    """A 60-word prompt spends more than the key's 40 tokens a minute: the next request waits."""
    client = mesh.client("thrifty")
    done = client.completions.create(model="qa", prompt=words(60), max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.total_tokens > 40
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="qa", prompt="hello", max_tokens=2, temperature=0)
    assert int(e.value.response.headers["retry-after"]) >= 1 and "tokens per minute" in e.value.message


def test_the_log_names_key_ids_never_keys(mesh):
    mesh.client("a").completions.create(model="qa", prompt="hello", max_tokens=2, temperature=0)
    mesh.gateway.wait_for(lambda line: '"request"' in line and '"tenant": "A"' in line, 30, "tenant A's request line")
    (line, *_) = [r for r in mesh.gateway.events("request") if r.get("tenant") == "A"]
    assert line["key_id"] == mesh.keys["a"][4:16]  # dmk_<id>_<secret>
    log = "\n".join(mesh.gateway.lines)
    assert not [k for k in mesh.keys.values() if k[17:] in log]  # no key's secret part, anywhere


async def _prefill(mesh: Mesh, model: ModelAdapter, context: str, scope: str) -> None:
    """`droidmesh prefill --scope`, then wait until the broker serves it to that scope."""
    (mesh.tmp / "ctx.txt").write_text(context)
    out = await asyncio.to_thread(CliRunner().invoke, main, ["prefill", "--sender", "summ", "--context",
                                                             str(mesh.tmp / "ctx.txt"), "--scope", scope,
                                                             "--nats", mesh.url])
    assert out.exit_code == 0, out.output
    client = await MeshClient.connect(mesh.url)
    try:
        ids = text.context_ids(model.tokenizer, context)
        for _ in range(2000):
            if (await client.lookup(ids, model.fingerprint.id, scope=scope)).holder is not None:
                return
        raise TimeoutError("the broker never indexed the context")
    finally:
        await client.close()


def _served(client: openai.OpenAI, context: str) -> tuple[dict, int]:
    comp = client.completions.create(model="qa", prompt=context + QUESTION, max_tokens=4, temperature=0)
    details = comp.usage.prompt_tokens_details if comp.usage is not None else None
    return (comp.model_extra or {})["droidmesh"], (details.cached_tokens or 0) if details is not None else -1


def test_a_tenants_context_is_reused_by_it_and_never_by_another(mesh, tiny_models):
    """Cached for tenant A: B's identical prompt is its receiver's own full prefill (nothing pulled,
    nothing reported cached), while A's reuses the sender's KV. A's scope is the one `keys list`
    prints (an HMAC under the key file's secret): a context cached under the scope a client could
    form from A's name alone is not A's."""
    asyncio.run(_prefill(mesh, tiny_models[1], TENANT_CONTEXT, tenant_scope("A")))
    ext, _ = _served(mesh.client("a"), TENANT_CONTEXT)
    assert ext["path"] == "full_prefill" and ext["bytes_pulled"] == 0, ext
    listed = CliRunner().invoke(main, ["keys", "list", "--file", str(mesh.tmp / "keys.toml")])
    assert listed.exit_code == 0, listed.output
    scope_a = next(w.removeprefix("scope=") for line in listed.stdout.splitlines() if "tenant=A " in line
                   for w in line.split() if w.startswith("scope="))
    assert scope_a.startswith("tenant:A.") and scope_a != tenant_scope("A")
    asyncio.run(_prefill(mesh, tiny_models[1], TENANT_CONTEXT, scope_a))
    ext, cached = _served(mesh.client("b"), TENANT_CONTEXT)
    assert ext["path"] == "full_prefill" and ext["bytes_pulled"] == 0 and ext["reused_tokens"] == 0, ext
    assert cached == 0 and ext["sender_id"] is None
    ext, cached = _served(mesh.client("a"), TENANT_CONTEXT)
    assert ext["path"] != "full_prefill" and ext["bytes_pulled"] > 0 and ext["reused_tokens"] > 0, ext
    assert cached == ext["reused_tokens"]


def test_a_public_context_is_reused_by_every_tenant(mesh, tiny_models):
    asyncio.run(_prefill(mesh, tiny_models[1], PUBLIC_CONTEXT, PUBLIC))
    for name in ("a", "b"):
        ext, cached = _served(mesh.client(name), PUBLIC_CONTEXT)
        assert ext["path"] != "full_prefill" and ext["bytes_pulled"] > 0 and cached > 0, (name, ext)
