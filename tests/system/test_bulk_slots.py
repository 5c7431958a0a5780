"""Idle peers cannot lock receivers out of a real bulk server process (ucx, nixl, shm).

A sender's bulk server (`make_server` with small `SlotLimits`: 8 connections, 4 per peer, and a
setup deadline far longer than the test, so only slot eviction can admit anyone) runs as its own
process and prints, on SIGUSR1, the connections it holds per peer and what it let go and why.
Hostile peers run as their own processes (over TCP each from its own loopback source address,
127.0.0.2 and up; over shm each process is a peer) and open connections and idle: silent, or
after the channel's setup (a UCX hello, a NIXL or an shm pull, each with a forged grant). Then:
  - one peer that opens 12 connections holds 4 (its own oldest give way to its newest);
  - with the server full of idle connections, an honest receiver (this process, 127.0.0.1)
    still connects and completes a pull with a valid grant: the least recently active idle
    connection gives way;
  - the server process stays alive and logged what it dropped.
Without slots (a plain cap, idle timeouts of 600 s) the hostile peer held all 8 and the honest
pull was refused: its connection was closed on arrival.

Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from droidmesh.shared.service.launch import Proc
from droidmesh.shared.transport import slots
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.wire.schemas import PullItem, PullRequest

pytestmark = [pytest.mark.system, pytest.mark.security]

SIZE = 4096  # the one tensor the server holds (bf16, context id "4096", layer 0 K)
CAP, PER_PEER = 8, 4
IO_S = 30.0  # the longest one wait for a process's line may take
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

SERVER = """
import asyncio, json, signal, sys
import torch
from droidmesh.shared.transport.bulk import make_server
from droidmesh.shared.transport.slots import SlotLimits
from droidmesh.shared.transport.tokens import TokenIssuer

async def main(transport, cap, per_peer, size, per_grantee):
    tensors = {str(size): torch.randn(size // 2).to(torch.bfloat16)}
    issuer = TokenIssuer(ttl_s=600)
    server = make_server(transport, lambda c, l, k: tensors.get(c) if (l, k) == (0, "K") else None,
                         lambda req: issuer.verify(req.context_id, req.token),
                         limits=SlotLimits(max_connections=cap, per_peer=per_peer, per_grantee=per_grantee,
                                           setup_s=3600, idle_s=3600))
    tensors.update(zip(tensors, server.place(list(tensors.values())), strict=True))
    address = await server.start()
    print("GRANT=" + issuer.issue(str(size))[0], flush=True)
    print("GRANTEE_GRANTS=" + ",".join(issuer.issue(str(size), grantee="receiver-x")[0] for _ in range(4)), flush=True)
    print("BULK_ADDRESS=" + address, flush=True)
    loop, stop, seq = asyncio.get_running_loop(), asyncio.Event(), [0]

    def report():
        seq[0] += 1
        print(f"SLOTS {seq[0]} " + json.dumps({"held": server.slots.held(), "counts": server.slots.counts,
                                               "grantees": server.slots.held_by_grantee()}), flush=True)

    loop.add_signal_handler(signal.SIGUSR1, report)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
"""

HOSTILE = """
import socket, struct, sys, time
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullItem, PullRequest

transport, address, source, mode, count, io_s = sys.argv[1:5] + [int(sys.argv[5]), float(sys.argv[6])]

def connect():
    if transport == "shm":
        for _ in range(int(io_s * 100)):  # a full backlog refuses a Unix connect with a timeout: retry, bounded
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(io_s)
            try:
                s.connect(address)
                return s
            except BlockingIOError:
                s.close()
                time.sleep(0.01)
        raise OSError("the server's backlog stayed full")
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=io_s, source_address=(source, 0))

def read_exactly(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise OSError("closed by the server")
        out += chunk
    return out

def send_frame(s, msg):
    data = schemas.encode(msg)
    s.sendall(len(data).to_bytes(4, "big") + data)

def read_frame(s):
    return read_exactly(s, int.from_bytes(read_exactly(s, 4), "big"))

forged = PullRequest(context_id="4096", items=[PullItem(0, "K")], token="1.forged.0")
if mode == "forged" and transport == "ucx":  # a real UCX worker address in the hello
    from droidmesh.shared.transport.ucx import ucxx
    own = bytes(ucxx().get_worker_address().tobytes())

def engage(s):
    if mode == "forged" and transport == "ucx":
        request = schemas.encode(forged)
        s.sendall(struct.Struct(">4sQII").pack(b"DMU2", 7, len(own), len(request)) + own + request)
        read_frame(s)  # the refusing welcome
    elif mode == "forged":
        send_frame(s, forged)
        read_frame(s)  # the refusal

held = []
for _ in range(count):
    s = connect()
    engage(s)
    held.append(s)
print("OPENED", len(held), flush=True)
sys.stdin.read()  # idle, holding every connection, until the test closes our stdin
"""


def _slots(proc: Proc, seq: Iterator[int], pred: Callable[[dict], bool], what: str) -> dict:
    """The server's slot report once `pred` holds for it (asked again, a bounded number of times:
    the server admits what the kernel accepted in its own time)."""
    report: dict = {}
    for _ in range(200):
        n = next(seq)
        os.kill(proc.popen.pid, signal.SIGUSR1)
        line = proc.wait_for(lambda l, n=n: l.startswith(f"SLOTS {n} "), IO_S, f"slot report {n}")
        report = json.loads(line.split(" ", 2)[2])
        if pred(report):
            return report
        time.sleep(0.05)  # a pause between reports, not a measurement
    raise AssertionError(f"the server never reached: {what}; last report {report}\n{proc.tail()}")


def _hostile(transport: str, address: str, source: str, mode: str, count: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOSTILE, transport, address, source, mode, str(count), str(IO_S)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    assert p.stdout is not None
    line = p.stdout.readline()  # each connect and exchange is bounded by IO_S in the child
    assert line.startswith("OPENED"), f"the hostile peer failed (status {p.wait(IO_S)}): {line}"
    return p


def _server(services: list[Proc], transport: str, per_peer: int, per_grantee: int) -> tuple[Proc, str, list[str], str]:
    """The bulk server process (skipped where the channel is unavailable): (process, a grant for
    anyone, grants that went to one grantee, its address)."""
    proc = Proc(f"bulk-{transport}", [sys.executable, "-c", SERVER, transport, str(CAP), str(per_peer), str(SIZE),
                                      str(per_grantee)], env=ENV)
    services.append(proc)
    grant = proc.wait_for(lambda l: l.startswith(("GRANT=", "Traceback")), 120, "its grant")
    if not grant.startswith("GRANT="):
        pytest.skip(f"{transport} server unavailable here: {proc.tail()}")
    grants = proc.wait_for(lambda l: l.startswith("GRANTEE_GRANTS="), IO_S, "its grantee's grants")
    address = proc.wait_for(lambda l: l.startswith("BULK_ADDRESS="), IO_S, "its address")
    return (proc, grant[len("GRANT="):], grants[len("GRANTEE_GRANTS="):].split(","),
            address[len("BULK_ADDRESS="):])


def _honest_pull(transport: str, address: str, grant: str) -> int:
    async def pull() -> int:
        client = make_client(transport)
        try:
            into = [torch.empty(SIZE // 2, dtype=torch.bfloat16)]
            return await client.pull(address, PullRequest(context_id=str(SIZE), items=[PullItem(0, "K")], token=grant),
                                     into, lambda *a: None, 60)
        finally:
            await client.close()

    return asyncio.run(pull())


@pytest.mark.parametrize(("transport", "engaged"), [("ucx", "forged"), ("nixl", "forged"), ("shm", "forged")])
def test_idle_peers_at_the_cap_do_not_lock_out_an_honest_receiver(services, transport, engaged):
    if transport == "nixl":
        pytest.importorskip("nixl_cu12")
    proc, grant, _, address = _server(services, transport, PER_PEER, CAP)
    seq = iter(range(1, 10**6))
    peer = (lambda p: f"pid {p.pid} uid {os.getuid()}") if transport == "shm" else None
    hostile: list[subprocess.Popen] = []
    try:
        # one peer opens 3x its cap (after the channel's setup) and idles: it holds its cap
        first = _hostile(transport, address, "127.0.0.2", engaged, 3 * PER_PEER)
        hostile.append(first)
        one = peer(first) if peer else "127.0.0.2"
        report = _slots(proc, seq, lambda r: r["counts"].get(slots.EVICTED_PEER, 0) == 2 * PER_PEER,
                        "the first peer's extra connections let go")
        assert report["held"] == {one: PER_PEER}, report
        # another peer fills the server with silent connections
        second = _hostile(transport, address, "127.0.0.3", "silent", CAP - PER_PEER)
        hostile.append(second)
        report = _slots(proc, seq, lambda r: sum(r["held"].values()) == CAP, "the server full")
        assert report["counts"].get(slots.EVICTED, 0) == 0, report
        # full of idle connections, the server still takes an honest receiver's pull
        assert _honest_pull(transport, address, grant) == SIZE
        report = _slots(proc, seq, lambda r: r["counts"].get(slots.EVICTED, 0) >= 1, "an idle connection evicted")
        assert report["held"].get(one, 0) == PER_PEER - 1, report  # the least recently active: the first peer's
        assert report["counts"].get(slots.REFUSED, 0) == 0, report
        proc.wait_for(lambda l: f"{transport}_connection_dropped" in l and re.search(r"reason\W{1,4}evicted(?!_)", l) is not None,
                      IO_S, "the eviction logged")
        assert proc.popen.poll() is None, f"the server exited with status {proc.popen.returncode}:\n{proc.tail()}"
    finally:
        for p in hostile:
            assert p.stdin is not None
            p.stdin.close()
            try:
                p.wait(IO_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _hold_pulls(transport: str, address: str, grants: list[str], then: Callable[[], dict]) -> dict:
    """One client per grant, each pulling once with it and keeping its connection (as a receiver
    caches one per sender), then `then()` while all are open."""
    async def go() -> dict:
        clients = [make_client(transport) for _ in grants]
        try:
            for client, grant in zip(clients, grants, strict=True):
                into = [torch.empty(SIZE // 2, dtype=torch.bfloat16)]
                await client.pull(address, PullRequest(context_id=str(SIZE), items=[PullItem(0, "K")], token=grant),
                                  into, lambda *a: None, 60)
            return await asyncio.to_thread(then)
        finally:
            for client in clients:
                await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("transport", ["ucx", "shm"])
def test_one_grantee_holds_at_most_its_cap_of_connections(services, transport):
    """Connections whose pulls use grants that went to one NATS user (three of them, where the
    per-peer cap would allow eight) hold at most `per_grantee` (2) of the server's slots: the third
    connection's first pull takes the place of the grantee's least recently active one."""
    per_grantee = 2
    proc, _, grants, address = _server(services, transport, CAP, per_grantee)
    seq = iter(range(1, 10**6))
    report = _hold_pulls(transport, address, grants[:3], lambda: _slots(
        proc, seq, lambda r: r["counts"].get(slots.EVICTED_GRANTEE, 0) >= 1, "the grantee's oldest connection let go"))
    assert report["grantees"] == {"receiver-x": per_grantee}, report
    assert report["counts"].get(slots.EVICTED_GRANTEE) == 1 and not report["counts"].get(slots.REFUSED_GRANTEE), report
    assert proc.popen.poll() is None, proc.tail()
