"""The gateway under abuse, as real processes (nats-server, broker, receiver, gateway): idle
connections at a 1,024-descriptor limit, per-client fairness, clients leaving their streams, NATS
down at start, fields the bus cannot carry, oversized prompts and stream subjects aimed elsewhere.

Every wait has a deadline; nothing asserts how long anything took."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import fresh_password
from droidmesh.shared.service.launch import Proc, free_port, local_login, start_nats, start_service
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest, Sampling
from tests.system.conftest import health_port, words

pytestmark = [pytest.mark.system, pytest.mark.security]

THREADS = {"OMP_NUM_THREADS": "1"}
DESCRIPTORS = 1024  # a common default soft limit: the gateway runs under it
IDLE = 1100  # more idle connections than the gateway has descriptors
MAX_TOKENS = 1024
DEADLINE_S = 120.0
HONEST_S = 30.0  # what an honest client waits for one answer
# Settings newer than some gateways: passed as environment, which a gateway without them ignores.
LIMITS = {"DM_GATEWAY_MAX_INFLIGHT_PER_CLIENT": "2", "DM_GATEWAY_MAX_INFLIGHT_PER_PEER": "3"}
# A prompt and seed whose sampled answer runs to max_tokens (no early EOS) on the ci tier's qa.
LONG = {"model": "qa", "prompt": "the story of the old lighthouse keeper and", "max_tokens": MAX_TOKENS,
        "temperature": 1.0, "seed": 7}


def _limited(n: int) -> list[str]:
    """A command prefix that runs the rest under an `n`-descriptor limit (soft and hard)."""
    code = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
            "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", code]


def http(base: str, method: str, path: str, body: dict | None = None, key: str = "",
         timeout: float = DEADLINE_S) -> tuple[int | str, dict]:
    """(status, JSON body) of one request; a connection failure is its exception's name."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError as e:
        return type(e).__name__, {}


class Mesh:
    def __init__(self, url: str, receiver: Proc, gateway: Proc):
        self.url, self.receiver, self.gateway = url, receiver, gateway
        self.port = gateway.events("gateway_started")[0]["http_port"]
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def call(self, method: str, path: str, body: dict | None = None, key: str = "",
             timeout: float = DEADLINE_S) -> tuple[int | str, dict]:
        return http(self.base, method, path, body, key, timeout)

    def inflight(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port(self.gateway)}/metrics", timeout=DEADLINE_S) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("dm_gateway_inflight "):
                    return float(line.split()[1])
        return 0.0


@pytest.fixture(scope="module")
def mesh(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    nats, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")))
    procs: list[Proc] = [nats]
    try:
        procs.append(start_service("cache_broker", {}, url, env=THREADS))
        receiver = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "qa"}, url, env=THREADS)
        procs.append(receiver)
        gateway = start_service("gateway", {"http_port": 0, "metrics_port": 0, "max_tokens_limit": MAX_TOKENS}, url,
                                env=LIMITS, wrap=_limited(DESCRIPTORS))
        procs.append(gateway)
        yield Mesh(url, receiver, gateway)
    finally:
        for p in reversed(procs):
            p.stop()


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {DEADLINE_S}s")
        time.sleep(0.05)


def test_idle_connections_do_not_lock_out_an_honest_client(mesh):
    """1,100 idle connections against a gateway with 1,024 descriptors: an honest client still
    lists the models and gets a chat answer, and the gateway never runs out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 256:
        pytest.skip(f"this test process may open only {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, IDLE + 1024)), hard))
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):
            s = socket.socket()
            s.settimeout(5.0)
            try:
                s.connect(("127.0.0.1", mesh.port))
                idle.append(s)
            except OSError:  # refused or timed out: counts against the gateway below, never hangs here
                s.close()
        models = mesh.call("GET", "/models", timeout=HONEST_S)
        chat = mesh.call("POST", "/chat/completions", {"model": "qa", "max_tokens": 4, "temperature": 0,
                                                       "messages": [{"role": "user", "content": words(20)}]},
                         timeout=HONEST_S)
    finally:
        for s in idle:
            s.close()
    assert models[0] == 200 and [m["id"] for m in models[1]["data"]] == ["qa"], models
    assert chat[0] == 200 and chat[1]["object"] == "chat.completion", chat
    assert mesh.gateway.popen.poll() is None
    assert not [line for line in mesh.gateway.lines if "Too many open files" in line or "EMFILE" in line]


def test_a_client_leaving_its_stream_stops_the_receivers_decode(mesh):
    """A streaming client that goes away after its first event: the receiver stops decoding (its
    request line says cancelled, with fewer tokens than asked for) instead of decoding them all."""
    async def leave_early() -> str:
        async with aiohttp.ClientSession() as s, s.post(f"{mesh.base}/completions", json={**LONG, "stream": True},
                                                        timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
        # leaving the blocks closed the connection
        return str(json.loads(first.decode().removeprefix("data: "))["id"]).removeprefix("cmpl-")

    rid = asyncio.run(leave_early())  # the request id: only this request's line is read (other tests cancel too)

    def mine() -> list[dict]:
        return [r for r in mesh.receiver.events("request") if r.get("request_id") == rid]

    _until(lambda: bool(mine()), f"the receiver's request line of {rid}")
    (line,) = mine()
    assert line.get("cancelled") and line["new_tokens"] < line["max_new_tokens"] == MAX_TOKENS, line


def test_one_client_cannot_take_every_slot(mesh):
    """A client (address + key) holding its limit of requests is refused 429 for more, so is a new
    key once the address holds its own limit; the slots come back when those requests end."""
    async def run() -> list[int | str]:
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async def stream(key: str) -> None:
                async with s.post(f"{mesh.base}/completions", json={**LONG, "stream": True},
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.content.readuntil(b"\n\n")
                    await asyncio.sleep(DEADLINE_S)  # hold it until cancelled

            async def status(key: str) -> int | str:
                return (await asyncio.to_thread(mesh.call, "POST", "/completions", {**LONG, "max_tokens": 1}, key))[0]

            held = [asyncio.create_task(stream("a")) for _ in range(2)]
            await asyncio.to_thread(_until, lambda: mesh.inflight() >= 2, "two requests in flight")
            out = [await status("a")]  # a's third
            held.append(asyncio.create_task(stream("b")))
            await asyncio.to_thread(_until, lambda: mesh.inflight() >= 3, "three requests in flight")
            out.append(await status("c"))  # a new key on an address at its limit
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await asyncio.to_thread(_until, lambda: mesh.inflight() == 0, "the held requests ending")
            out.append(await status("a"))
            return out

    assert asyncio.run(run()) == [429, 429, 200]


def test_a_field_the_bus_cannot_carry_is_a_400(mesh):
    """A seed past 64 bits passes JSON but not the bus's msgpack: a one-line 400 naming it, never a 500."""
    status, body = mesh.call("POST", "/completions", {"model": "qa", "prompt": "p", "seed": 2**64})
    assert status == 400 and body["error"]["param"] == "seed" and "\n" not in body["error"]["message"], body


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(mesh):
    """A prompt near the body cap whose characters could not fit the model's positions is refused
    on its length in characters, without being tokenized first."""
    status, body = mesh.call("POST", "/completions", {"model": "qa", "prompt": "a " * 200_000, "max_tokens": 4})
    assert status == 400 and "characters cannot fit" in body["error"]["message"], body


def test_streams_go_only_to_a_listening_stream_inbox(mesh):
    """A stream subject shaped like a reply subject is refused; a stream inbox nobody listens to
    stops the request after its first chunk instead of decoding into nowhere."""
    async def run() -> tuple[schemas.ErrorReply, schemas.ErrorReply]:
        client = await MeshClient.connect(mesh.url)
        try:
            async def ask(stream_subject: str) -> schemas.ErrorReply:
                """The receiver's error reply (an answer instead fails to decode as one)."""
                req = GenerateRequest(request_id=uuid.uuid4().hex[:12], context=str(LONG["prompt"]), question="",
                                      max_new_tokens=MAX_TOKENS, sampling=Sampling(temperature=1.0, seed=7),
                                      stream_subject=stream_subject, budget_s=DEADLINE_S)
                data = await client.bus.request(subjects.receiver_generate("qa"), schemas.encode(req), DEADLINE_S)
                return schemas.decode(data, schemas.ErrorReply)

            nc = client.bus.nc  # type: ignore[attr-defined]  # a NatsBus
            reply_like = await ask(f"{nc.new_inbox()}.1")
            nowhere = await ask(f"{subjects.INBOX_PREFIX}.{uuid.uuid4().hex}")
            return reply_like, nowhere
        finally:
            await client.close()

    reply_like, nowhere = asyncio.run(run())
    assert reply_like.code == "bad_request" and "stream_subject" in reply_like.message
    assert nowhere.code == "client_gone", nowhere


def test_with_nats_down_the_port_answers_503_until_nats_is_up(tmp_path):
    """A gateway started while NATS is down listens anyway and answers a one-line 503; once NATS
    is up on its URL the same port serves."""
    nats_port, http_port = free_port(), free_port()
    password = fresh_password()  # the server started later takes it
    login, _ = local_login(password)
    gateway = Proc("gateway", [sys.executable, "-m", "droidmesh.services.gateway", "--nats-url",
                               f"nats://{login}127.0.0.1:{nats_port}", "--http-port", str(http_port)],
                   env={"PYTHONUNBUFFERED": "1"})
    nats = None
    try:
        gateway.wait_for(lambda line: '"gateway_started"' in line, DEADLINE_S, "the API listening")
        base = f"http://127.0.0.1:{http_port}/v1"
        down = http(base, "GET", "/models")
        nats, _ = start_nats(port=nats_port, store_dir=str(tmp_path / "js"), password=password)
        _until(lambda: http(base, "GET", "/models")[0] == 200, "an answer once NATS is up")
    finally:
        gateway.stop()
        if nats is not None:
            nats.stop()
    status, body = down
    assert status == 503 and body["error"]["code"] == "service_unavailable" and "\n" not in body["error"]["message"]
