"""The gateway under abuse, in process: the connection cap and its idle eviction, the head and body
deadlines, per-client fairness (429), the port answering 503 before the mesh is joined, and request
fields that pass validation but not the bus's encoding (400)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from droidmesh.services.gateway import fairness
from droidmesh.services.gateway import openai as oa
from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.guard import connection_cap, refusal_bytes
from droidmesh.services.gateway.service import GatewayService
from droidmesh.services.gateway.state import NOT_CONNECTED
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.wire.generation import Sampling
from tests.unit.services.test_gateway_handlers import CHAT, FakeMesh, _state, serve

DEADLINE_S = 30.0  # every wait below ends by then


def running(fn: Callable[[GatewayService], Awaitable[Any]], mesh: FakeMesh | None = None, **cfg: Any) -> Any:
    """`fn(service)` against a real GatewayService (its own listener and guard) on a free port."""
    async def run() -> Any:
        svc = GatewayService(GatewayConfig(http_port=0, **cfg), bus=InProcessBus(), client=mesh or FakeMesh())
        async with svc:
            return await fn(svc)

    return asyncio.run(run())


async def raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), DEADLINE_S)


async def stream_started(session: aiohttp.ClientSession, port: int, key: str = "") -> aiohttp.ClientResponse:
    """A streamed chat whose first event has arrived (its request is in flight until closed)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers)
    assert r.status == 200, await r.text()
    await asyncio.wait_for(r.content.readuntil(b"\n\n"), DEADLINE_S)
    return r


def test_at_the_cap_the_longest_idle_connection_makes_room():
    """With the cap held by idle connections, an honest request is served: the connection idle
    longest is closed for it, never one with a request in flight."""
    async def go(svc: GatewayService) -> tuple[int, bytes, bool]:
        idle = [await raw(svc.http_port) for _ in range(4)]  # the cap, all idle
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{svc.http_port}/v1/models") as r:
            status = r.status
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{svc.http_port}/v1/models") as r:
            status = max(status, r.status)
        oldest = await asyncio.wait_for(idle[0][0].read(), DEADLINE_S)  # closed to make room: EOF
        for _, w in idle:
            w.close()
        return status, oldest, svc.state is not None and svc.state.guard.cap == 4

    status, oldest, capped = running(go, max_connections=4)
    assert status == 200 and oldest == b"" and capped


def test_at_the_cap_with_every_connection_busy_a_newcomer_gets_a_503():
    """When every connection has a request in flight, a new connection is answered with one 503 and closed."""
    async def go(svc: GatewayService) -> bytes:
        async with aiohttp.ClientSession() as s:
            streams = [await stream_started(s, svc.http_port, key=f"k{i}") for i in range(2)]
            reader, writer = await raw(svc.http_port)
            answer = await asyncio.wait_for(reader.read(), DEADLINE_S)
            writer.close()
            for r in streams:
                r.close()
        return answer

    answer = running(go, FakeMesh(endless=True), max_connections=2)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "service_unavailable"
    assert answer == refusal_bytes(json.loads(body)["error"]["message"])


def test_a_connection_that_never_sends_its_head_is_closed():
    """The head deadline closes a silent connection, and one trickling a partial head."""
    async def go(svc: GatewayService) -> list[bytes]:
        silent = await raw(svc.http_port)
        trickle = await raw(svc.http_port)
        trickle[1].write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        return [await asyncio.wait_for(c[0].read(), DEADLINE_S) for c in (silent, trickle)]

    assert running(go, header_timeout_s=0.2) == [b"", b""]


def test_a_body_that_does_not_arrive_in_time_is_408():
    """A body slower than body_timeout_s is refused 408 (OpenAI-shaped), not waited for."""
    async def go(svc: GatewayService) -> bytes:
        reader, writer = await raw(svc.http_port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")
        answer = await asyncio.wait_for(reader.read(), DEADLINE_S)
        writer.close()
        return answer

    answer = running(go, body_timeout_s=0.2)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer


def test_a_client_over_its_in_flight_limit_gets_429_and_others_still_pass():
    """Per client (address + key) and per address: the request over either limit is 429; another
    client's key still gets its share until the address's limit."""
    async def go(svc: GatewayService) -> list[int]:
        out = []
        url = f"http://127.0.0.1:{svc.http_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            held = [await stream_started(s, svc.http_port, key="a")]
            async with s.post(url, json=CHAT, headers={"Authorization": "Bearer a"}) as r:
                out.append(r.status)  # a's second: over the per-client limit
            held.append(await stream_started(s, svc.http_port, key="b"))  # b: its own share
            async with s.post(url, json=CHAT, headers={"Authorization": "Bearer c"}) as r:
                out.append(r.status)  # c: a new key, but the address holds its limit
            for r in held:
                r.close()
            for _ in range(int(DEADLINE_S / 0.05)):  # the gateway notices the streams end at its next write
                if svc.state is not None and svc.state.clients.inflight("127.0.0.1") == (0, 0):
                    break
                await asyncio.sleep(0.05)
            async with s.post(url, json=CHAT, headers={"Authorization": "Bearer a"}) as r:
                out.append(r.status)  # once the streams are gone, a is served again
        return out

    assert running(go, FakeMesh(endless=True), max_inflight_per_client=1, max_inflight_per_peer=2) == [429, 429, 200]


def test_peers_and_keys():
    """A peer is an IPv4 address or an IPv6 /64 (v4-mapped addresses are their v4); keys are digests."""
    assert fairness.peer_of("10.0.0.7") == "10.0.0.7"
    assert fairness.peer_of("2001:db8::1") == fairness.peer_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert fairness.peer_of("::ffff:10.0.0.7") == "10.0.0.7"
    assert fairness.key_digest("") == "" and fairness.key_digest("Bearer x") != fairness.key_digest("Bearer y")
    limits = fairness.ClientLimits(per_client=1, per_peer=0)
    with limits.admit("p", "k"), pytest.raises(oa.RateLimitedError), limits.admit("p", "k"):
        pass
    assert limits.inflight("p", "k") == (0, 0)


def test_the_cap_stays_under_the_descriptor_limit():
    """The connection cap is lowered below the process's descriptor limit, never raised."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(10) == 10
    assert connection_cap(10**9) < soft


def test_before_the_mesh_is_joined_requests_are_503():
    """The placeholder mesh (NATS not connected yet) makes every mesh request a one-line 503."""
    async def go(c: TestClient) -> list[tuple[int, dict]]:
        return [(r.status, await r.json()) for r in (await c.get("/v1/models"), await c.post("/v1/chat/completions", json=CHAT))]

    for status, body in serve(_state(NOT_CONNECTED, mesh_up=lambda: False), go):
        assert status == 503 and body["error"]["code"] == "service_unavailable" and "\n" not in body["error"]["message"]


@pytest.mark.parametrize("fields", [{"seed": 2**64}, {"seed": -1}, {"seed": 2**63}])
def test_fields_the_bus_cannot_carry_are_400(fields):
    """A seed past the receivers' 63 bits (which msgpack could not carry past 64) is a 400 naming it."""
    async def go(c: TestClient) -> tuple[int, dict]:
        r = await c.post("/v1/completions", json={"model": "qa", "prompt": "p", **fields})
        return r.status, await r.json()

    status, body = serve(_state(FakeMesh()), go)
    assert status == 400 and body["error"]["param"] == "seed" and "\n" not in body["error"]["message"]


def test_a_call_the_bus_cannot_encode_is_a_one_line_400():
    """Whatever passed the request's own checks but not the bus's encoding is a 400, never a 500."""
    call = oa.parse_completion(json.dumps({"model": "qa", "prompt": "p"}).encode(), oa.Limits(16, 64))
    bad = oa.MeshCall(**{**call.__dict__, "sampling": Sampling(seed=2**70)})
    with pytest.raises(oa.InvalidRequestError) as e:
        oa._fits_bus(bad)
    assert oa.to_http(e.value, "r")[0] == 400 and "\n" not in str(e.value)


def test_the_listener_survives_a_peer_that_resets_at_once():
    """A connection reset right after connecting leaves the listener serving."""
    async def go(svc: GatewayService) -> int:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", svc.http_port), timeout=DEADLINE_S)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
            s.close()
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{svc.http_port}/v1/models") as r:
            return r.status

    assert running(go) == 200


def test_running_out_of_descriptors_pauses_accepting_with_one_line(monkeypatch):
    """An accept failing for want of descriptors stops accepting for a pause (pinned here to an hour)
    and logs one line: no retry per pending connection, no hot loop."""
    import errno

    import structlog
    from aiohttp import web

    from droidmesh.services.gateway import guard

    monkeypatch.setattr(guard, "ACCEPT_PAUSE_S", 3600.0)

    class Exhausted(socket.socket):
        attempts = 0

        def accept(self):  # type: ignore[override]
            Exhausted.attempts += 1
            raise OSError(errno.EMFILE, "Too many open files")

    async def go() -> tuple[int, list[dict], bool]:
        server = web.Server(lambda request: web.Response())
        sock = Exhausted(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        listener = guard.Listener(sock, server, guard.ConnectionGuard(8))
        clients = [socket.create_connection(sock.getsockname(), timeout=DEADLINE_S) for _ in range(3)]
        with structlog.testing.capture_logs() as logs:
            listener.start()
            for _ in range(int(DEADLINE_S / 0.01)):  # until the first attempt
                if Exhausted.attempts:
                    break
                await asyncio.sleep(0.01)
            for _ in range(50):  # many loop turns with connections still pending
                await asyncio.sleep(0)
        paused = listener._resume is not None
        listener.close()
        for c in clients:
            c.close()
        return Exhausted.attempts, logs, paused

    attempts, logs, paused = asyncio.run(go())
    assert attempts == 1 and paused
    assert [entry["event"] for entry in logs] == ["accept_failed"] and logs[0]["error"] == "EMFILE"
