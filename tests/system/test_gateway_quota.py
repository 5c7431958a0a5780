"""Two gateway replicas with one key file, on a real nats-server under the shipped roster's users
(each gateway logs in as `gateway`, with that user's permissions): a key's requests per minute
hold across both, the file is read again without a restart, and `cache_salt` is accepted.

No receiver is needed: every request is admitted or refused before the mesh is asked (a key's
request for a model it may not use is 403 after admission, so 403 counts as admitted, 429 as refused)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import pytest
from click.testing import CliRunner
from nats.errors import TimeoutError as NatsTimeout

from droidmesh.shared.auth import keys
from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, MeshAccess
from droidmesh.shared.service.launch import Proc, start_secure_nats
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.wire.subjects import CONFIG_BUCKET, QUOTA_BUCKET
from tests.system.conftest import start_together, stop_together

pytestmark = pytest.mark.system

RPM = 30  # the limited key's requests a minute
WORKERS_PER_GATEWAY = 3


class Replicas:
    def __init__(self, procs: list[Proc], path: Path, keys_: dict[str, str], access: MeshAccess):
        self.procs, self.path, self.keys, self.access = procs, path, keys_, access
        self.bases = [f"http://127.0.0.1:{p.events('gateway_started')[0]['http_port']}" for p in procs]


def _add_key(path: Path, tenant: str, *extra: str) -> str:
    out = CliRunner().invoke(main, ["keys", "add", "--file", str(path), "--tenant", tenant, "--models", "qa", *extra])
    assert out.exit_code == 0, out.output
    return out.stdout.strip()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("quota")
    path = tmp / "keys.toml"
    made = {"limited": _add_key(path, "acme", "--rpm", str(RPM), "--concurrency", "64"),
            "other": _add_key(path, "beta", "--rpm", "600")}
    nats, access = start_secure_nats(DEFAULT_ROSTER, store_dir=str(tmp / "js"), log_dir=tmp / "logs")
    procs: list[Proc] = []
    try:
        spec = ("gateway", {"http_port": 0, "api_keys": path}, {"env": access.env_for("gateway")})
        start_together(access.url, [spec, spec], procs)
        for p in procs:  # the shared buckets need NATS: requests before it are held to local limits
            p.wait_for(lambda line: "gateway_mesh_joined" in line, 60, "mesh joined")
        yield Replicas(procs, path, made, access)
    finally:
        stop_together(procs)
        nats.stop()


def _call(base: str, key: str, method: str = "GET", path: str = "/v1/models/code", body: dict | None = None
          ) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_two_replicas_hold_one_keys_limit_between_them(replicas):
    """Three clients per gateway, all on one key of 30 requests a minute, each asking until it is
    refused: the key is admitted 30 times in all (plus what refills while they ask), within 10 %.

    On per-process quotas (the gateway before its limits were shared) each replica admits the key
    its full 30: 60 in all, a ratio of 2.0."""
    key = replicas.keys["limited"]

    def client(base: str) -> list[int]:
        statuses = []
        while not statuses or statuses[-1] != 429:
            status, body = _call(base, key)
            assert status in (403, 429), body  # admitted then refused its model, or over the key's rate
            statuses.append(status)
        return statuses

    began = time.monotonic()
    # one request to each replica first, in turn: that both serve the key must not ride on which
    # replica's threads the scheduler starts first (one drained all 30 in 0.1 s on a busy host)
    first = [_call(base, key)[0] for base in replicas.bases]
    with ThreadPoolExecutor(2 * WORKERS_PER_GATEWAY) as pool:
        runs = list(pool.map(client, [b for b in replicas.bases for _ in range(WORKERS_PER_GATEWAY)]))
    elapsed = time.monotonic() - began
    per_gateway = [(first[i] == 403) + sum(run.count(403) for run in runs[i * WORKERS_PER_GATEWAY:(i + 1) * WORKERS_PER_GATEWAY])
                   for i in range(2)]
    admitted = sum(per_gateway)
    ratio = admitted / RPM
    print(f"admitted {admitted} of a {RPM}/min key in {elapsed:.2f}s (per gateway {per_gateway}): ratio {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1, (admitted, per_gateway, elapsed)
    assert all(n > 0 for n in per_gateway)  # both replicas served it
    for p in replicas.procs:  # the shared buckets were used, not each replica's local fall-back
        assert not p.events("quota_shared_unavailable"), p.tail()


def test_cache_salt_is_accepted_and_a_removed_key_is_refused_without_a_restart(replicas):
    other = replicas.keys["other"]
    chat = {"model": "code", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for base in replicas.bases:  # parsed (then 403: the key's models), not refused as an unknown parameter
        status, body = _call(base, other, "POST", "/v1/chat/completions", {**chat, "cache_salt": "team-1"})
        assert status == 403, body
        status, body = _call(base, other, "POST", "/v1/chat/completions", {**chat, "cache_salt": ""})
        assert status == 400 and body["error"]["param"] == "cache_salt", body
    kid = keys.KEY.fullmatch(other).group(1)  # type: ignore[union-attr]
    text = replicas.path.read_text()
    entries = text.split("[[key]]")
    replicas.path.write_text("[[key]]".join(e for e in entries if f'id = "{kid}"' not in e))
    assert kid not in replicas.path.read_text() and keys.load(replicas.path)
    deadline = time.monotonic() + 30  # a generous bound: the gateways look every second
    refused = [False, False]
    while not all(refused) and time.monotonic() < deadline:
        refused = [_call(base, other)[0] == 401 for base in replicas.bases]
        time.sleep(0.2)
    assert all(refused)
    for p in replicas.procs:
        assert p.events("key_file_reloaded"), p.tail()


def test_the_gateway_user_reaches_the_quota_bucket_and_no_other(replicas):
    """What the gateways wrote is there under the `gateway` login; the same login may neither write
    the recompute-config bucket (which exists: `admin` made it) nor make a stream of its own. The
    server drops both requests, so they go unanswered (an allowed one is answered at once)."""

    async def go() -> None:
        admin = await nats.connect(replicas.access.url, **replicas.access.options("admin"))
        nc = await nats.connect(replicas.access.url, **replicas.access.options("gateway"))
        try:
            await admin.jetstream().create_key_value(bucket=CONFIG_BUCKET)
            js = nc.jetstream(timeout=1.0)
            kid = keys.KEY.fullmatch(replicas.keys["limited"]).group(1)  # type: ignore[union-attr]
            entry = await (await js.key_value(QUOTA_BUCKET)).get(kid)
            assert set(json.loads(entry.value)) == {"v", "r", "t", "at"}
            with pytest.raises(NatsTimeout):
                await js.publish(f"$KV.{CONFIG_BUCKET}.forged", b"x")
            with pytest.raises(NatsTimeout):
                await js.add_stream(name="mine", subjects=["mine.>"])
        finally:
            await nc.close()
            await admin.close()

    asyncio.run(go())
