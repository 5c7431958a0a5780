"""The NIXL bulk channel: one-sided reads of the sender's registered memory (tried on one host).

The protocol and its checks are `shared/transport/bulk.py`'s; this module moves the control
messages over a small TCP stream (length-prefixed msgpack frames, each bounded by
`schemas.MAX_MESSAGE_BYTES` before it is read, every read under a deadline) and the bytes by
NIXL READs, which the receiver's agent performs straight into its own buffers:
  1. per connection: `NixlConnect` -> `NixlAgentInfo` (the sender agent's connection info, no
     memory); the receiver loads it and connects its agent ahead of the first pull;
  2. per pull: `PullRequest` -> `NixlGrant`. The sender authorizes and answers (`bulk.answer`),
     registers each payload's memory (a stored tensor's once, reused across pulls) and grants
     NIXL metadata for exactly those registrations plus one region per item. A refusal carries
     no metadata and no regions: nothing of the sender's memory is reachable without a grant;
  3. the receiver checks the headers (`bulk.landings`), registers its landing buffers (the
     caller's own for raw on the CPU) and READs one transfer request per run of consecutive
     same-layer items (a layer's K and V together; the E items lead the request, so each goes
     on its own unless the K/V of its layer follow it directly), all queued at once;
     as each completes, in request order, its items are verified, decoded and handed to `on_item`;
  4. `NixlDone` tells the sender the reads are over, so it releases what it held for this pull
     (per-pull registrations, payload copies). A dropped connection releases the same.

Each side's NIXL agent lives on one worker thread of its own (the agent is created without
locks), and every agent call is made there. With UCX on one host a READ is a CMA copy done
inside the post call with the GIL released, so the bytes never run on the event loop; where a
post returns in progress (a network transport), the loop polls the state with short sleeps.
NIXL's progress thread serves the sender's side of such reads; it sleeps on UCX events when idle.

Registrations: the server keeps a stored tensor's registration keyed by (address, nbytes)
while that tensor lives (a weak reference to what the lookup returned); one whose tensor is
gone and no pull holds is deregistered before the next grant or on close. Nothing here keeps a
tensor alive beyond its pull, so the store's byte budget still bounds memory; a lapsed
registration lingers until the next grant (with RDMA transports its pages stay pinned till then).
A grant's metadata stays loaded on the receiver's agent while its connection lives: capability
is checked when a pull is granted, not on each READ. On one host the OS is the real boundary
(CMA reads need ptrace rights over the sender); NIXL itself refuses descriptors outside the
loaded grants.

The NIXL wheel (`nixl-cu12`, the `mesh` extra) is imported on first use. NIXL's own descriptor
serialization is pickle; nothing here unpickles a peer's bytes (regions travel as typed fields).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import itertools
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import structlog
import torch
from droidmesh.shared.errors import BadMessageError, DroidMeshError, TransferError
from droidmesh.shared.transport.bulk import (
    MAX_REQUEST_BYTES,
    Authorize,
    Landing,
    OnItem,
    Pin,
    TensorLookup,
    answer,
    as_is,
    guarded_pull,
    landings,
)
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.ucx import parse_address
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import (
    NixlAgentInfo,
    NixlConnect,
    NixlDone,
    NixlGrant,
    NixlRegion,
    PullRequest,
    PullResponse,
    Transport,
)

log = structlog.get_logger("nixl")
M = TypeVar("M", bound=schemas.Message)
T = TypeVar("T")

NIXL_MODULES = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings")  # CUDA 12 / 13 wheels, source build
HANDSHAKE_S = 10.0  # sender: a new connection's NixlConnect
IDLE_S = 600.0  # sender: an idle connection's next PullRequest
HOLD_S = 120.0  # sender: the longest a grant is held before its NixlDone
SEND_S = 30.0  # either side: a control frame must be taken by the peer within this
# NIXL's progress thread waits this long (µs) for UCX events when idle. It wakes on events, so
# this is no latency; nixl_agent hard-codes 0, which spins a whole core per agent even when idle.
PROGRESS_IDLE_US = 100_000
_POLL_S = (0.00005, 0.001)  # in-progress transfer: first and longest sleep between state checks
_HEADER = 4  # frame length prefix, big-endian


def _bindings() -> Any:
    """NIXL's C++ bindings; `TransferError` when no NIXL wheel is installed."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError("the nixl transport needs NIXL: pip install 'droidmesh[mesh]' (nixl-cu12)")


class _Agent:
    """A NIXL agent with the UCX backend, confined to one worker thread: `call` / `submit` run
    work there, and every other method must only run there. Built on the bindings rather than
    `nixl_agent` for its progress thread's idle wait (`PROGRESS_IDLE_US`)."""

    def __init__(self, role: str):
        self.name = f"droidmesh-{role}-{uuid.uuid4().hex[:12]}"
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"nixl-{role}")
        self._b: Any = None
        self._agent: Any = None
        self._ucx: list[int] = []

    async def start(self) -> None:
        b = self._b = _bindings()

        def create() -> None:
            cfg = b.nixlAgentConfig()
            cfg.useProgThread, cfg.pthrDelay = True, PROGRESS_IDLE_US
            cfg.useListenThread, cfg.syncMode = False, b.NIXL_THREAD_SYNC_NONE  # one thread calls it
            agent = b.nixlAgent(self.name, cfg)
            if "UCX" not in agent.getAvailPlugins():
                raise TransferError("NIXL's UCX plugin is missing from this install")
            self._ucx = [agent.createBackend("UCX", {})]
            self._agent = agent

        await self.call(create)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    def register(self, regions: Sequence[tuple[int, int]]) -> Any:
        descs = self._b.nixlRegDList(self._b.DRAM_SEG, _rows(regions))
        self._agent.registerMem(descs, self._ucx)
        return descs

    def deregister(self, descs: Any) -> None:
        self._agent.deregisterMem(descs, self._ucx)

    def metadata(self, regions: Sequence[tuple[int, int]], connection: bool) -> bytes:
        """This agent's metadata for exactly `regions` (registered), with or without its
        connection info."""
        descs = self._b.nixlRegDList(self._b.DRAM_SEG, _rows(regions))
        return bytes(self._agent.getLocalPartialMD(descs, connection, self._ucx))

    def load(self, metadata: bytes) -> str:
        """Load a peer's metadata (added to what is loaded for it already); its agent name."""
        name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, peer: str) -> None:
        self._agent.makeConnection(peer, self._ucx)

    def forget(self, peer: str) -> None:
        self._agent.invalidateRemoteMD(peer)

    def read(self, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str) -> tuple[int, str]:
        """Post one READ of `remote` regions of `peer` into `local` ones; (handle, state)."""
        b = self._b
        handle = self._agent.createXferReq(b.NIXL_READ, b.nixlXferDList(b.DRAM_SEG, _rows(local)),
                                           b.nixlXferDList(b.DRAM_SEG, _rows(remote)), peer, "", self._ucx)
        return handle, self._state(self._agent.postXferReq(handle, ""))

    def state(self, handle: int) -> str:
        return self._state(self._agent.getXferStatus(handle))

    def _state(self, status: Any) -> str:
        return "DONE" if status == self._b.NIXL_SUCCESS else "PROC" if status == self._b.NIXL_IN_PROG else "ERR"

    def release(self, handle: int) -> None:
        self._agent.releaseXferReq(handle)  # cancels a transfer still in progress

    def close(self) -> None:
        """Destroy the agent on its thread, then stop the thread."""
        self._pool.submit(self._destroy).result()
        self._pool.shutdown(wait=True)

    def _destroy(self) -> None:
        self._agent = None


def _rows(regions: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.array([(a, n, 0) for a, n in regions], dtype=np.uint64).reshape(-1, 3)  # (addr, len, device)


# -- frames -----------------------------------------------------------------------------------
async def _send(writer: asyncio.StreamWriter, msg: schemas.Message) -> None:
    """Send one frame; a peer that does not take it within SEND_S fails the send."""
    data = schemas.encode(msg)
    if len(data) > schemas.MAX_MESSAGE_BYTES:
        raise TransferError(f"{type(msg).__name__} of {len(data)} bytes exceeds {schemas.MAX_MESSAGE_BYTES}")
    writer.write(len(data).to_bytes(_HEADER, "big") + data)
    async with asyncio.timeout(SEND_S):
        await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, cap: int = schemas.MAX_MESSAGE_BYTES) -> bytes:
    """One frame's bytes; its declared length is checked against `cap` before reading it."""
    n = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if n > cap:
        raise BadMessageError(f"frame of {n} bytes exceeds {cap}")
    return await reader.readexactly(n)


async def _recv(reader: asyncio.StreamReader, kind: type[M], deadline_s: float) -> M:
    async with asyncio.timeout(deadline_s):
        return schemas.decode(await _read_frame(reader, MAX_REQUEST_BYTES), kind)


# -- server -----------------------------------------------------------------------------------
class _Registration:
    """One registered payload region. `owner` (a weak reference to the stored tensor) is set when
    the region is that tensor's own memory, which makes the registration reusable across pulls."""

    def __init__(self, region: tuple[int, int], descs: Any, owner: weakref.ref[torch.Tensor] | None):
        self.region, self.descs, self.owner = region, descs, owner
        self.pins = 0  # grants in flight that use it

    def lapsed(self) -> bool:
        return self.pins == 0 and (self.owner is None or self.owner() is None)


class NixlBulkServer:
    """Grants `PullRequest`s from a tensor lookup (the sender's store) for NIXL reads."""

    transport: Transport = "nixl"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._agent: _Agent | None = None
        self._listener = ControlListener("nixl", self._serve_connection)
        self._regs: dict[tuple[int, int], _Registration] = {}  # stored tensors' regions
        self._regs_lock = asyncio.Lock()

    place = staticmethod(as_is)

    async def start(self) -> str:
        """Listen on the configured host only (`ControlListener`); return "host:port"."""
        self._agent = _Agent("nixl-sender")
        await self._agent.start()
        address, bound = await self._listener.start(self._host, self._port)
        log.info("nixl_server_started", agent=self._agent.name, bound=bound[0], port=bound[1])
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        agent = self._agent
        assert agent is not None  # connections are accepted only after start()
        try:
            await _recv(reader, NixlConnect, HANDSHAKE_S)
            info = await agent.call(agent.metadata, [], True)  # connection info, no memory
            await _send(writer, NixlAgentInfo(metadata=info))
            while True:
                async with asyncio.timeout(IDLE_S):
                    data = await _read_frame(reader, MAX_REQUEST_BYTES)
                grant, held, payloads, release = await self._grant(data)
                try:
                    await _send(writer, grant)
                    if not grant.response.error:
                        await _recv(reader, NixlDone, HOLD_S)
                finally:
                    try:
                        await self._release(held)  # while `payloads` (per-pull copies) still live
                    finally:
                        release()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the receiver closed or dropped the connection: what it held is released above
        except Exception as e:  # a bad peer or a NIXL failure ends this connection, never the server
            log.warning("nixl_connection_dropped", error=f"{type(e).__name__}: {e}")

    async def _grant(self, data: bytes
                     ) -> tuple[NixlGrant, list[_Registration], list[torch.Tensor], Callable[[], None]]:
        """The grant for one request, the registrations it pins, the payloads they cover and the
        release of the pull's hold on the store."""
        try:
            request = schemas.decode(data, PullRequest)
        except DroidMeshError as e:
            return NixlGrant(response=PullResponse(headers=[], error=f"{e.code}: {str(e)[:500]}")), [], [], _nothing
        stored: list[torch.Tensor | None] = []

        def lookup(context_id: str, layer: int, kind: str) -> torch.Tensor | None:
            stored.append(self._lookup(context_id, layer, kind))  # answer looks each item up once, in order
            return stored[-1]

        response, payloads, release = answer(request, lookup, self._authorize, self._pin)
        if response.error:
            return NixlGrant(response=response), [], [], release
        try:
            payloads = [p.contiguous() for p in payloads]
            held, metadata = await self._register(stored, payloads)
        except BaseException:
            release()
            raise
        return (NixlGrant(response=response, metadata=metadata,
                          regions=[NixlRegion(addr=p.data_ptr(), nbytes=p.numel()) for p in payloads]),
                held, payloads, release)

    async def _register(self, stored: list[torch.Tensor | None], payloads: list[torch.Tensor]
                        ) -> tuple[list[_Registration], bytes]:
        """Pin a registration for every non-empty payload (the cached one of a stored tensor's own
        memory, or a new one for a payload the codec produced, released with the grant) and return
        them with NIXL metadata for exactly those; lapsed registrations are dropped first. One
        call on the agent's thread does all three."""
        agent = self._agent
        assert agent is not None
        async with self._regs_lock:
            lapsed = [self._regs.pop(k) for k, r in list(self._regs.items()) if r.lapsed()]
            held, new = [], []
            for t, p in zip(stored, payloads, strict=True):
                region = (p.data_ptr(), p.numel())
                if not region[1]:
                    continue  # nothing to read
                owned = t is not None and _within(p, t)
                reg = self._regs.get(region) if owned else None
                if reg is None:
                    reg = _Registration(region, None, weakref.ref(t) if owned and t is not None else None)
                    new.append(reg)
                    if owned:
                        self._regs[region] = reg
                reg.pins += 1
                held.append(reg)

            def register() -> bytes:
                _deregister(agent, lapsed)
                for reg in new:
                    reg.descs = agent.register([reg.region])
                regions = [r.region for r in held]
                return agent.metadata(regions, False) if regions else b""

            try:
                return held, await agent.call(register)
            except BaseException:
                for reg in held:
                    reg.pins -= 1
                for reg in new:
                    self._regs.pop(reg.region, None)
                await asyncio.shield(agent.call(_deregister, agent, new))  # those registered before the failure
                raise

    async def _release(self, held: list[_Registration]) -> None:
        for reg in held:
            reg.pins -= 1
        async with self._regs_lock:
            for reg in held:
                if reg.lapsed() and self._regs.get(reg.region) is reg:
                    del self._regs[reg.region]
            lapsed = [r for r in dict.fromkeys(held) if r.lapsed()]
            if lapsed and self._agent is not None:
                await self._agent.call(_deregister, self._agent, lapsed)

    async def close(self) -> None:
        await self._listener.close()
        if self._agent is not None:
            await self._agent.call(_deregister, self._agent, list(self._regs.values()))
            self._regs.clear()
            self._agent.close()
            self._agent = None


def _nothing() -> None:
    """The release of a pull that holds nothing."""


def _deregister(agent: _Agent, regs: list[_Registration]) -> None:
    """On the agent's thread: deregister what was registered of `regs`."""
    for reg in regs:
        if reg.descs is not None:
            agent.deregister(reg.descs)
            reg.descs = None


def _within(payload: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `payload`'s bytes are `t`'s own memory (raw on the CPU), not a fresh encoding."""
    if t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start <= payload.data_ptr() and payload.data_ptr() + payload.numel() <= start + storage.nbytes()


def _release_reads(agent: _Agent, handles: list[Any], registered: Any) -> None:
    """On the agent's thread: release a pull's remaining transfers, then its landing buffers."""
    try:
        for handle in handles:
            agent.release(handle)
    finally:
        if registered is not None:
            agent.deregister(registered)


# -- client -----------------------------------------------------------------------------------
class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str):
        self.reader, self.writer, self.peer = reader, writer, peer  # peer: the sender agent's name


class NixlBulkClient:
    """Pulls over cached connections (one per sender address, one pull at a time each)."""

    transport: Transport = "nixl"

    def __init__(self) -> None:
        self._agent: _Agent | None = None
        self._conns: dict[str, _Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull `request`'s items into `into`; return the payload bytes received.

        Raises `TransferError` (peer gone, refused, deadline, protocol violation) or
        `IntegrityError` (header or checksum mismatch). On any error the connection is dropped,
        which releases the sender's grant; it is never reused half-read."""
        async def pull() -> int:
            return await self._pull_on(await self._connection(address), request, into, on_item)

        return await guarded_pull(address, timeout_s, self._locks.setdefault(address, asyncio.Lock()), pull,
                                  lambda: self._drop(address))

    async def _pull_on(self, conn: _Connection, request: PullRequest, into: Sequence[torch.Tensor],
                       on_item: OnItem) -> int:
        await _send(conn.writer, request)
        grant = schemas.decode(await _read_frame(conn.reader), NixlGrant)
        lands = landings(request, grant.response, into)
        if [r.nbytes for r in grant.regions] != [land.header.nbytes for land in lands]:
            raise TransferError(f"grant regions {[r.nbytes for r in grant.regions]} do not match the headers")
        agent = self._agent
        assert agent is not None
        moving = [(land, region) for land, region in zip(lands, grant.regions, strict=True) if region.nbytes]
        local = [(land.recv.data_ptr(), land.recv.numel()) for land, _ in moving]

        def register() -> Any:
            if not local:
                return None
            agent.load(grant.metadata)  # the grant's regions join what is loaded for the sender
            return agent.register(local)

        registered = await agent.call(register)
        in_flight: list[Any] = []  # transfer handles posted but not done when posted
        try:
            await self._read(agent, conn.peer, lands, grant.regions, on_item, in_flight)
        finally:  # queued behind every post on the agent's thread, so it runs after them all
            await asyncio.shield(agent.call(_release_reads, agent, in_flight, registered))
        await _send(conn.writer, NixlDone())
        return sum(land.header.nbytes for land in lands)

    async def _read(self, agent: _Agent, peer: str, lands: list[Landing], regions: list[NixlRegion],
                    on_item: OnItem, in_flight: list[Any]) -> None:
        """READ each run of same-layer items as one transfer, all posted in order on the agent's
        thread; deliver each run's items as its transfer completes."""
        runs = [list(run) for _, run in itertools.groupby(zip(lands, regions, strict=True),
                                                          key=lambda lr: lr[0].item.layer)]
        abandoned = False

        def post(run: list[tuple[Landing, NixlRegion]]) -> tuple[Any, str]:
            moving = [(land, r) for land, r in run if r.nbytes]
            if abandoned or not moving:
                return None, "DONE"
            handle, state = agent.read([(land.recv.data_ptr(), r.nbytes) for land, r in moving],
                                       [(r.addr, r.nbytes) for _, r in moving], peer)
            if state == "PROC":
                in_flight.append(handle)
                return handle, state
            agent.release(handle)  # a same-host READ is done by now: one hop saved
            return None, state

        posts = [asyncio.wrap_future(agent.submit(post, run)) for run in runs]
        try:
            for run, posted in zip(runs, posts, strict=True):
                await self._complete(agent, *await posted)
                for land, _ in run:
                    on_item(land.item, land.land())
        finally:
            abandoned = True  # posts still queued do nothing
            await asyncio.shield(asyncio.gather(*posts, return_exceptions=True))

    @staticmethod
    async def _complete(agent: _Agent, handle: Any, state: str) -> None:
        delay = _POLL_S[0]
        while state == "PROC":
            await asyncio.sleep(delay)
            delay = min(2 * delay, _POLL_S[1])
            state = await agent.call(agent.state, handle)
        if state != "DONE":
            raise TransferError(f"NIXL read failed ({state})")

    async def _connection(self, address: str) -> _Connection:
        conn = self._conns.get(address)
        if conn is not None and not conn.reader.at_eof():
            return conn
        await self._drop(address)  # the sender closed an idle connection: dial again
        if self._agent is None:
            agent = _Agent("nixl-receiver")
            await agent.start()
            self._agent = agent
        agent = self._agent
        reader, writer = await asyncio.open_connection(*parse_address(address))
        try:
            await _send(writer, NixlConnect())
            info = schemas.decode(await _read_frame(reader), NixlAgentInfo)

            def connect() -> str:
                peer = agent.load(info.metadata)
                agent.connect(peer)  # the first READ would otherwise wait for this
                return peer

            peer = await agent.call(connect)
        except BaseException:
            writer.close()
            raise
        self._conns[address] = conn = _Connection(reader, writer, peer)
        return conn

    async def _drop(self, address: str) -> None:
        """Close the connection (the sender releases its grants) and forget the sender agent's
        metadata, so nothing it granted stays readable."""
        conn = self._conns.pop(address, None)
        if conn is None:
            return
        conn.writer.close()
        agent = self._agent
        if agent is not None:
            try:
                await asyncio.shield(agent.call(agent.forget, conn.peer))
            except Exception as e:  # already gone on the agent's side: nothing left to forget
                log.debug("nixl_remove_remote_failed", peer=conn.peer, error=str(e))

    async def warm(self, address: str) -> None:
        """Connect both the control stream and the NIXL agents ahead of the first pull."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._connection(address)

    async def close(self) -> None:
        for address in list(self._conns):
            await self._drop(address)
        if self._agent is not None:
            self._agent.close()
            self._agent = None
