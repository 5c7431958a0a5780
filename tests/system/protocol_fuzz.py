"""A fuzzer of *valid* bulk-channel protocol sequences in wrong orders, against a real sender process.

`python -m tests.system.protocol_fuzz CHANNEL --sequences N [--seed S]` starts a sender
(`tensor_server CHANNEL 38528,40000 --fill canary --grant-requests`: two contexts, each its own
canary, a grant per pull supplied on request) and runs N sequences of well-formed messages in
random orders, on one connection until it closes: pulls with a valid grant, with none, with one
for the other context, with a used or forged one; a done before any grant, a pull while a grant
is outstanding, a close mid-pull; for nixl also READs of the grant's own regions, at their
edges and beyond (a descriptor of the granting agent widened to the whole address space, our
own remote key), after the done, and metadata loaded again mid-pull; for shm the memfds a grant
passes, read whole. After each message it checks the invariants and counts:
  - no byte outside a grant: every byte the peer gets (a READ, a payload, a memfd) carries the
    canary of a context granted on that connection, or none. A READ after the peer's own done
    may still find that grant's context for as long as the sender takes to release it (the peer
    chooses when to send its done, and could have read the same bytes before): such reads are
    counted apart (`read_after_done_bytes`), and any other context in them is a violation;
  - no process dies: the sender runs throughout (sandbox deaths are counted, not failures).
Prints one line `FUZZ=<json>` with the counts; exits 1 on any violation.
Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import queue
import random
import socket
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import numpy as np

from droidmesh.shared.tools.bench.tensor_server import ADDRESS_PREFIX, GRANT_PREFIX
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import NixlDone, NixlGrant, ShmDone, ShmGrant
from droidmesh.shared.wire.schemas import PullItem, PullRequest
from tests.system.attackers import CANARY, forged

A, B = "38528", "40000"
IO_S = 30.0
SEQ_STEPS = (2, 7)  # messages per sequence


class Sender:
    """The sender process, its grants on request, and whether it still runs."""

    def __init__(self, channel: str, env: dict[str, str]):
        argv = [sys.executable, "-m", "droidmesh.shared.tools.bench.tensor_server", channel, f"{A},{B}",
                "--fill", "canary", "--grant-requests"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.grants: dict[str, queue.Queue[str]] = {A: queue.Queue(), B: queue.Queue()}
        self.lines: list[str] = []
        self.address: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.addr = self.address.get(timeout=120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(GRANT_PREFIX):
                cid, token = line[len(GRANT_PREFIX):].split(" ")
                self.grants[cid].put(token)
            elif line.startswith(ADDRESS_PREFIX):
                self.address.put(line[len(ADDRESS_PREFIX):])
            elif line.startswith("BULK_ERROR="):
                self.address.put("")
            else:
                self.lines.append(line)

    def grant(self, cid: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cid + "\n")
        self.proc.stdin.flush()
        return self.grants[cid].get(timeout=IO_S)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def request(cid: str, token: str) -> PullRequest:
    return PullRequest(context_id=cid, token=token, items=[PullItem(layer=0, kind="K")], codec="raw", codec_params={},
                       tokens=0)


class Fuzz:
    def __init__(self, sender: Sender, rnd: random.Random):
        self.sender, self.rnd = sender, rnd
        self.counts: Counter[str] = Counter()
        self.used: list[str] = []  # tokens spent on this sender

    def token(self, cid: str) -> tuple[str, str]:
        """(kind, token) for a pull of `cid`: valid, none, the other context's, used, forged."""
        kind = self.rnd.choice(["valid", "valid", "valid", "none", "other", "used", "forged"])
        if kind == "valid":
            token = self.sender.grant(cid)
            self.used.append(token)
        elif kind == "other":
            token = self.sender.grant(B if cid == A else A)
        elif kind == "used" and self.used:
            token = self.rnd.choice(self.used)
        elif kind == "forged":
            token = "9999999999999.forged." + "0" * 64
        else:
            kind, token = "none", ""
        self.counts[f"token_{kind}"] += 1
        return kind, token

    def seen(self, data: bytes, live: set[str], what: str, released: frozenset[str] = frozenset()) -> None:
        """Check `data` carries no canary outside `live` (the contexts granted and not done);
        one in `released` (the connection's own grant the peer said done with) is counted apart."""
        self.counts[f"{what}_bytes"] += len(data)
        for m in set(CANARY.findall(data)):
            cid = m.decode()
            if cid in live:
                continue
            if cid in released:
                self.counts[f"{what}_after_done_bytes"] += len(data)
                continue
            self.counts["violations"] += 1
            print(f"VIOLATION {what}: context {cid} outside the live grants {sorted(live)}", flush=True)


async def frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: schemas.Message | None,
                raw: bytes = b"") -> bytes:
    data = schemas.encode(msg) if msg is not None else raw
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), IO_S), "big")
    return await asyncio.wait_for(reader.readexactly(n), IO_S)


async def nixl_sequence(f: Fuzz, conn: dict[str, Any]) -> None:
    """Messages on the connection in `conn` (opened here when there is none)."""
    from droidmesh.shared.transport.nixl.agent import Agent

    if "agent" not in conn:
        conn["agent"] = Agent("fuzz")
        await conn["agent"].start()
        conn["buf"] = np.zeros(1 << 16, dtype=np.uint8)
        await conn["agent"].call(conn["agent"].register, [(conn["buf"].ctypes.data, 1 << 16)])
    agent, buf = conn["agent"], conn["buf"]
    if conn.get("writer") is None:
        host, port = f.sender.addr.rsplit(":", 1)
        conn["reader"], conn["writer"] = await asyncio.open_connection(host, int(port))
        conn["peer"], conn["granted"] = None, None
        f.counts["connections"] += 1
    reader, writer = conn["reader"], conn["writer"]
    for _ in range(f.rnd.randint(*SEQ_STEPS)):
        op = f.rnd.choice(["pull", "pull", "pull", "pull", "done", "done", "read", "read_edge", "read_edge", "reload", "close"])
        f.counts[f"op_{op}"] += 1
        granted = conn["granted"]
        if op == "pull":
            cid = f.rnd.choice([A, B])
            _, token = f.token(cid)
            grant = schemas.decode(await frame(reader, writer, request(cid, token)), NixlGrant)
            if granted is not None:  # a pull while a grant is outstanding: the sender wanted its done
                f.counts["refused" if grant.response.error else "granted_out_of_order"] += 1
            if grant.response.error:
                f.counts["refused"] += 1
                if grant.metadata or grant.regions:
                    f.counts["violations"] += 1
                    print("VIOLATION refusal carrying metadata", flush=True)
                continue
            f.counts["granted"] += 1

            def load(md: bytes = grant.metadata) -> str:
                name = agent.load(md)
                if conn["peer"] is None:
                    agent.connect(name)
                    agent.load(forged(agent.metadata([(buf.ctypes.data, 1 << 16)], False), name))
                return name

            conn["peer"] = await agent.call(load)
            conn["granted"] = (cid, grant.regions[0].addr, grant.regions[0].nbytes, grant.metadata)
        elif op == "done":
            writer.write(len(d := schemas.encode(NixlDone())).to_bytes(4, "big") + d)
            await writer.drain()
            if granted is None:  # a done before any grant: answered as a (malformed) request
                grant = schemas.decode(await asyncio.wait_for(_read_frame(reader), IO_S), NixlGrant)
                f.counts["refused" if grant.response.error else "granted_out_of_order"] += 1
            conn["granted"] = None
            conn["done"] = granted
        elif op in ("read", "read_edge") and conn["peer"] is not None:
            target = granted or conn.get("done")
            if target is None:
                continue
            _, addr, n, _ = target
            if op == "read":
                at, size = addr, min(n, len(buf))
            else:
                at = f.rnd.choice([addr - 4096, addr - 1, addr + n - 8, addr + n, addr + n + 4096, addr - (1 << 20)])
                size = f.rnd.choice([64, 4096, len(buf)])
            data = await _read(agent, buf, max(at, 0), size, conn["peer"])
            f.counts["reads_done" if data is not None else "reads_failed"] += 1
            if data is not None:
                f.seen(data, {granted[0]} if granted else set(), "read", frozenset() if granted else frozenset({target[0]}))
        elif op == "reload" and granted is not None:
            await agent.call(agent.load, granted[3])
        elif op == "close":
            await close_nixl(conn)
            return


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = int.from_bytes(await reader.readexactly(4), "big")
    return await reader.readexactly(n)


async def _read(agent: Any, buf: np.ndarray, addr: int, size: int, peer: str) -> bytes | None:
    buf[:] = 0
    try:
        handle, state = await agent.call(agent.read, [(buf.ctypes.data, size)], [(addr, size)], peer)
        for _ in range(int(IO_S * 100)):
            if state != "PROC":
                break
            await asyncio.sleep(0.01)
            state = await agent.call(agent.state, handle)
        await agent.call(agent.release, handle)
    except Exception:
        return None
    return buf[:size].tobytes() if state == "DONE" else None


async def close_nixl(conn: dict[str, Any]) -> None:
    if conn.get("writer") is not None:
        conn["writer"].close()
        conn["writer"] = None
    if conn.get("peer") is not None:
        try:
            await conn["agent"].call(conn["agent"].forget, conn["peer"])
        except Exception:
            pass
        conn["peer"] = None
    conn["granted"] = conn["done"] = None


async def ucx_sequence(f: Fuzz, conn: dict[str, Any]) -> None:
    from droidmesh.shared.transport.ucx import ops, runtime, wireup

    u = runtime.ucxx()
    for _ in range(f.rnd.randint(*SEQ_STEPS)):
        op = f.rnd.choice(["pull", "pull", "pull", "pull", "pull", "garbage", "close"])
        f.counts[f"op_{op}"] += 1
        if op == "close" or (op == "garbage" and conn.get("ep") is None):
            close_ucx(conn)
            return
        ep = conn.get("ep")
        if op == "garbage":  # a well-formed message of another kind as the next request
            await ops.send_obj(ep, schemas.encode(NixlDone()))
            response = schemas.decode(await asyncio.wait_for(ops.recv_frame(ep, schemas.MAX_MESSAGE_BYTES), IO_S),
                                      schemas.PullResponse)
            f.counts["refused" if response.error else "granted_out_of_order"] += 1
            continue
        cid = f.rnd.choice([A, B])
        _, token = f.token(cid)
        if ep is None:
            if conn.get("writer") is None:
                host, port = f.sender.addr.rsplit(":", 1)
                conn["reader"], conn["writer"] = await asyncio.open_connection(host, int(port))
                f.counts["connections"] += 1
            tag = f.rnd.getrandbits(64)
            conn["writer"].write(wireup.hello(tag, u.get_worker_address().tobytes(), schemas.encode(request(cid, token))))
            welcome = await asyncio.wait_for(wireup.read_welcome(conn["reader"]), IO_S)
            if welcome.error:
                f.counts["refused"] += 1
                if welcome.address:
                    f.counts["violations"] += 1
                    print("VIOLATION refusal carrying an address", flush=True)
                continue
            ep = conn["ep"] = await wireup.endpoint_to(u, welcome.address, welcome.tag, tag, conn["writer"])
        else:
            await ops.send_obj(ep, schemas.encode(request(cid, token)))
        response = schemas.decode(await asyncio.wait_for(ops.recv_frame(ep, schemas.MAX_MESSAGE_BYTES), IO_S),
                                  schemas.PullResponse)
        if response.error:
            f.counts["refused"] += 1
            continue
        f.counts["granted"] += 1
        payload = np.empty(response.headers[0].nbytes, dtype=np.uint8)
        await asyncio.wait_for(ep.recv(payload), IO_S)
        f.seen(payload.tobytes(), {cid}, "payload")


def close_ucx(conn: dict[str, Any]) -> None:
    from droidmesh.shared.transport.ucx import ops

    ops.abort(conn.pop("ep", None))
    if conn.get("writer") is not None:
        conn.pop("writer").close()


async def shm_sequence(f: Fuzz, conn: dict[str, Any]) -> None:
    from droidmesh.shared.transport import shm_io

    if conn.get("sock") is None:
        sock = conn["sock"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, f.sender.addr)
        conn["granted"] = None
        f.counts["connections"] += 1
    sock = conn["sock"]
    for _ in range(f.rnd.randint(*SEQ_STEPS)):
        op = f.rnd.choice(["pull", "pull", "pull", "done", "done", "close"])
        f.counts[f"op_{op}"] += 1
        if op == "close":
            sock.close()
            conn["sock"] = None
            return
        if op == "done":
            await shm_io.send_frame(sock, schemas.encode(ShmDone()))
            if conn["granted"] is None:  # a done before any grant: answered as a (malformed) request
                data, fds = await asyncio.wait_for(shm_io.recv_frame(sock, schemas.MAX_MESSAGE_BYTES, 64), IO_S)
                for fd in fds:
                    os.close(fd)
                f.counts["refused" if schemas.decode(data, ShmGrant).response.error else "granted_out_of_order"] += 1
            conn["granted"] = None
            continue
        cid = f.rnd.choice([A, B])
        _, token = f.token(cid)
        await shm_io.send_frame(sock, schemas.encode(request(cid, token)))
        if conn["granted"] is not None:  # the sender wanted its done: the connection ends
            f.counts["pull_before_done"] += 1
        data, fds = await asyncio.wait_for(shm_io.recv_frame(sock, schemas.MAX_MESSAGE_BYTES, 64), IO_S)
        try:
            grant = schemas.decode(data, ShmGrant)
            if grant.response.error:
                f.counts["refused"] += 1
                if fds:
                    f.counts["violations"] += 1
                    print("VIOLATION refusal carrying memfds", flush=True)
                continue
            f.counts["granted"] += 1
            conn["granted"] = cid
            for fd in fds:  # every byte of every memfd passed: only this context's
                size = os.fstat(fd).st_size
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
                    f.seen(mm[:], {cid}, "memfd")
        finally:
            for fd in fds:
                os.close(fd)


async def run(channel: str, sequences: int, seed: int) -> dict[str, Any]:
    sender = Sender(channel, {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    if not sender.addr:
        return {"channel": channel, "unavailable": sender.lines[-3:]}
    f = Fuzz(sender, random.Random(seed))
    step = {"nixl": nixl_sequence, "ucx": ucx_sequence, "shm": shm_sequence}[channel]
    conn: dict[str, Any] = {}
    try:
        for i in range(sequences):
            try:
                await asyncio.wait_for(step(f, conn), IO_S * 4)
            except Exception as e:  # the sender ended the connection (as it should, often): start another
                f.counts[f"ended_{type(e).__name__}"] += 1
                await {"nixl": close_nixl, "ucx": _aclose_ucx, "shm": _aclose_shm}[channel](conn)
            f.counts["sequences"] += 1
            if not sender.alive():
                break
            if i % 500 == 499:
                print(f"PROGRESS {channel} {i + 1}/{sequences}", file=sys.stderr, flush=True)
    finally:
        alive = sender.alive()
        sender.stop()
    died = sum("sandbox_died" in line for line in sender.lines)
    return {"channel": channel, "seed": seed, "sender_alive": alive, "sandbox_deaths": died, **dict(f.counts)}


async def _aclose_ucx(conn: dict[str, Any]) -> None:
    close_ucx(conn)


async def _aclose_shm(conn: dict[str, Any]) -> None:
    if conn.get("sock") is not None:
        conn.pop("sock").close()
    conn["sock"], conn["granted"] = None, None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.system.protocol_fuzz")
    parser.add_argument("channel", choices=("nixl", "ucx", "shm"))
    parser.add_argument("--sequences", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = asyncio.run(run(args.channel, args.sequences, args.seed))
    print("FUZZ=" + json.dumps(out), flush=True)
    return 0 if out.get("sender_alive") and not out.get("violations") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
