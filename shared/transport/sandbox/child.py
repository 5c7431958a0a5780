"""A sandbox process: one receiver connection's transport, holding only what that peer was granted.

Started by `host.py` (`python -m droidmesh.shared.transport.sandbox CHANNEL FD`), it talks to its
sender over the Unix socket FD (`shm_io` frames, `wire/sandbox.py`'s messages, memfds attached to
grants) and to the receiver over its own NIXL agent or UCX worker. Torch-free: it maps the memfds
it is passed and hands their bytes to the library as they are. It trusts its sender and nothing
else; whatever the receiver makes UCX or NIXL do (a read of any address, an endpoint from a
foreign library, an abort) reaches this process's memory only, which holds the library, the
contexts granted to this one connection while their pull lasts, and no credential. It dies with
its sender (PR_SET_PDEATHSIG) and ends when the sender closes the socket.

  nixl: per `SandboxServe`, map its memfds, register each payload with the agent and answer
        `SandboxMapped` (addresses and NIXL metadata for exactly those, with the agent's
        connection info the first time); `SandboxRelease` deregisters and unmaps them.
  ucx:  `SandboxWire` (the receiver's hello): its worker address checked against this process's
        UCX, an endpoint made, `SandboxWired` answered; then per `SandboxServe` the response and
        payloads sent over the endpoint (`SandboxServed`), and the receiver's next request frame
        passed up unread (`SandboxAsk`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import mmap
import os
import secrets
import signal
import socket
import sys
from typing import Any

import numpy as np
import structlog

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport import shm_io
from droidmesh.shared.transport.limits import MAX_ITEMS, MAX_REQUEST_BYTES
from droidmesh.shared.transport.seals import sealed_size
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.sandbox import (
    SandboxAsk,
    SandboxFailed,
    SandboxMapped,
    SandboxOrder,
    SandboxReady,
    SandboxRelease,
    SandboxServe,
    SandboxServed,
    SandboxWire,
    SandboxWired,
)

log = structlog.get_logger("sandbox")
UCX_OPTIONS_ENV = "DROIDMESH_SANDBOX_UCX"  # the sender's UCX options for this process, as JSON
SEND_S = 120.0  # a pull's response and payloads must be taken within this
MAX_ORDER_BYTES = schemas.MAX_MESSAGE_BYTES  # an order, as `schemas.decode` bounds every message
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


class Mapped:
    """One pull's memfds mapped read-only, and each payload as a numpy view of its bytes."""

    def __init__(self, serve: SandboxServe, fds: list[int]):
        self._maps: list[mmap.mmap] = []
        self.views: list[np.ndarray] = []  # [nbytes] uint8 per region, in order
        bases: list[np.ndarray] = []
        try:
            if len(fds) != serve.fds or len(serve.regions) > MAX_ITEMS:
                raise BadMessageError(f"a pull of {serve.fds} memfds and {len(serve.regions)} regions came with {len(fds)}")
            for fd in fds:
                size = _sealed_size(fd)
                # populated now, in one call: a peer's reads would otherwise fault every page in, one by one
                self._maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ))
                bases.append(np.frombuffer(self._maps[-1], dtype=np.uint8))  # [size]
            for r in serve.regions:
                if r.nbytes == 0:
                    self.views.append(np.empty(0, dtype=np.uint8))
                    continue
                if not 0 <= r.fd < len(bases) or not 0 <= r.offset <= len(bases[r.fd]) - r.nbytes:
                    raise BadMessageError(f"a region of {r.nbytes} bytes at {r.offset} outside its memfd")
                self.views.append(bases[r.fd][r.offset:r.offset + r.nbytes])
        except BaseException:
            del bases
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the pages

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every non-empty payload, in order."""
        return [(v.ctypes.data, v.nbytes) for v in self.views if v.nbytes]

    def close(self) -> None:
        """Unmap everything; a mapping something still views cannot be, and then this process
        must not go on (it would keep a context readable past its pull): `BufferError`."""
        self.views.clear()
        kept = 0
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                kept += 1
        self._maps.clear()
        if kept:
            raise BufferError(f"{kept} mapping(s) still viewed after the pull")


def _sealed_size(fd: int) -> int:
    """A sealed memfd's size (what a sender passes), else `BadMessageError`: nothing else is mapped."""
    size = sealed_size(fd, BadMessageError)
    if not size:
        raise BadMessageError("an empty memfd")
    return size


class NixlSandbox:
    """Registers granted payloads with this process's own NIXL agent, per pull."""

    async def start(self) -> None:
        from droidmesh.shared.transport.nixl.agent import Agent

        self.agent = Agent("nixl-sandbox")
        await self.agent.start()
        self._connected = False  # whether a grant carried our connection info yet

    async def run(self, sock: socket.socket) -> None:
        held: dict[int, tuple[Mapped, Any]] = {}
        while True:
            order, fds = await _recv(sock)
            if isinstance(order, SandboxRelease):
                if order.pull_id in held:
                    mapped, descs = held.pop(order.pull_id)
                    if descs is not None:
                        await self.agent.call(self.agent.deregister, descs)
                    mapped.close()
                continue
            if not isinstance(order, SandboxServe) or order.pull_id in held:
                raise BadMessageError(f"unexpected {type(order).__name__}")
            mapped = Mapped(order, fds)
            regions = mapped.regions()
            descs, metadata = await self.agent.call(self._register, regions, not self._connected)
            self._connected = self._connected or bool(regions)
            held[order.pull_id] = (mapped, descs)
            addrs = [v.ctypes.data if v.nbytes else 0 for v in mapped.views]
            await _send(sock, SandboxMapped(pull_id=order.pull_id, addrs=addrs, metadata=metadata))


    def _register(self, regions: list[tuple[int, int]], connection: bool) -> tuple[Any, bytes]:
        """On the agent's thread: register `regions`; their metadata (with connection info)."""
        if not regions:
            return None, b""
        descs = self.agent.register(regions)
        return descs, self.agent.metadata(regions, connection)


class UcxSandbox:
    """Serves one receiver over this process's own UCX worker and one endpoint."""

    async def start(self) -> None:
        from droidmesh.shared.transport.ucx import worker

        self.options = json.loads(os.environ.get(UCX_OPTIONS_ENV, "{}"))
        self.local = worker.local_view(self.options)  # fails here, before Ready, where UCX cannot run

    async def run(self, sock: socket.socket) -> None:
        from droidmesh.shared.transport.ucp_address import check_peer
        from droidmesh.shared.transport.ucx import ops, worker

        wire, _ = await _recv(sock)
        if not isinstance(wire, SandboxWire):
            raise BadMessageError(f"unexpected {type(wire).__name__} before the wire-up")
        check_peer(wire.address, self.local, wire.on_this_host)  # before UCX reads a byte of it
        u = worker.ucxx(self.options)
        ep = await u.create_endpoint_from_worker_address(u.get_ucx_address_from_buffer(wire.address))
        tag = secrets.randbits(64)
        ep._tags = {"msg_send": wire.tag, "msg_recv": tag}
        await _send(sock, SandboxWired(tag=tag, address=u.get_worker_address().tobytes()))
        try:
            while True:
                serve, fds = await _recv(sock)
                if not isinstance(serve, SandboxServe):
                    raise BadMessageError(f"unexpected {type(serve).__name__}")
                mapped = Mapped(serve, fds)
                try:
                    async with asyncio.timeout(SEND_S):
                        await ops.send_obj(ep, serve.response)
                        await asyncio.gather(*(ops.send(ep, v) for v in mapped.views if v.nbytes))
                except BaseException as e:
                    await _send(sock, SandboxServed(pull_id=serve.pull_id, error=f"{type(e).__name__}: {e}"[:300]))
                    return  # the endpoint is aborted below; this connection is over
                mapped.close()
                await _send(sock, SandboxServed(pull_id=serve.pull_id))
                await ops.wait_for_message(ep)
                await _send(sock, SandboxAsk(request=await ops.recv_frame(ep, MAX_REQUEST_BYTES)))
        finally:
            ops.abort(ep)


async def _recv(sock: socket.socket) -> tuple[SandboxOrder, list[int]]:
    data, fds = await shm_io.recv_frame(sock, MAX_ORDER_BYTES, MAX_ITEMS)
    try:
        return schemas.decode(data, SandboxOrder), fds  # type: ignore[arg-type]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def _send(sock: socket.socket, msg: schemas.Message) -> None:
    await shm_io.send_frame(sock, schemas.encode(msg))


async def serve(channel: str, fd: int) -> int:
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    sandbox = NixlSandbox() if channel == "nixl" else UcxSandbox()
    try:
        await sandbox.start()
        await _send(sock, SandboxReady(pid=os.getpid()))
        await sandbox.run(sock)
    except EOFError:
        return 0  # the sender closed: this connection is over
    except Exception as e:  # UCX refusing an address, NIXL failing a call: reported, then this process ends
        with contextlib.suppress(Exception):
            await _send(sock, SandboxFailed(error=f"{type(e).__name__}: {e}"[:500]))
        log.warning("sandbox_failed", channel=channel, error=f"{type(e).__name__}: {e}"[:300])
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("nixl", "ucx"):
        print("usage: python -m droidmesh.shared.transport.sandbox nixl|ucx FD", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the sender
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # nothing it runs gains privileges
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # under memory pressure the kernel ends a sandbox before its sender
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    structlog.contextvars.bind_contextvars(service="sandbox", pid=os.getpid())
    return asyncio.run(serve(argv[0], int(argv[1])))
