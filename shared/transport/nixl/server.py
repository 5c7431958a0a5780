"""The NIXL channel's sender side (`NixlBulkServer`): grants pulls as NIXL metadata the receiver's
agent reads from.

Per connection (its own task on the sender's event loop, `ControlListener`, which admits it to a
slot first: `slots.py`):
  1. `NixlConnect` (within HANDSHAKE_S) -> `NixlAgentInfo`: this agent's connection info, no memory;
  2. per pull, `PullRequest` -> `NixlGrant` (the wait for it bounded by the slot: the setup
     deadline from the connect until a pull completes, then the idle timeout; an idle connection's
     slot may go to a newcomer meanwhile). The sender authorizes and answers
     (`bulk.answer`), registers each payload's memory (a stored tensor's once, reused across pulls)
     and grants NIXL metadata for exactly those registrations plus one region per item. A refusal
     carries no metadata and no regions: nothing of the sender's memory is reachable without one;
  3. `NixlDone` (within HOLD_S) releases what the pull held (per-pull registrations, payload
     copies) and, after a grant, proves the connection (`Slot.pulled`). A dropped connection
     releases the same.
The sender never loads anything a receiver sends into its agent: a receiver's frames are msgpack
messages, bounded before they are read, and a bad one ends that connection (logged), never the
server.

Registrations: a stored tensor's is kept keyed by (address, nbytes) while that tensor lives (a weak
reference to what the lookup returned), and so is the metadata granted for a plan of such regions
(the same plan pulled again is granted without a call on the agent's thread); one whose tensor is gone and that no pull holds is
deregistered before the next grant or on close. Nothing here keeps a tensor alive beyond its pull,
so the store's byte budget still bounds memory; a lapsed registration lingers until the next grant
(with RDMA transports its pages stay pinned till then). NIXL's progress thread serves the sender's
side of the reads.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

import structlog
import torch

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.transport.bulk import MAX_REQUEST_BYTES, Authorize, Pin, TensorLookup, answer, as_is
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.nixl import frames
from droidmesh.shared.transport.nixl.agent import Agent
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import NixlAgentInfo, NixlConnect, NixlDone, NixlGrant, NixlRegion, PullRequest, PullResponse, Transport

log = structlog.get_logger("nixl")
HANDSHAKE_S = 10.0  # a new connection's NixlConnect (within the slot's setup deadline too)
HOLD_S = 120.0  # the longest a grant is held before its NixlDone
GRANTED_CACHE = 1024  # metadata blobs kept for plans granted before


class _Registration:
    """One registered payload region. `owner` (a weak reference to the stored tensor) is set when
    the region is that tensor's own memory, which makes the registration reusable across pulls."""

    def __init__(self, region: tuple[int, int], descs: object, owner: weakref.ref[torch.Tensor] | None):
        self.region, self.descs, self.owner = region, descs, owner
        self.pins = 0  # grants in flight that use it

    def lapsed(self) -> bool:
        return self.pins == 0 and (self.owner is None or self.owner() is None)


class NixlBulkServer:
    """Grants `PullRequest`s from a tensor lookup (the sender's store) for NIXL reads."""

    transport: Transport = "nixl"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None, limits: SlotLimits | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._agent: Agent | None = None
        self._listener = ControlListener("nixl", self._serve_connection, limits)
        self.slots = self._listener.slots
        self._regs: dict[tuple[int, int], _Registration] = {}  # stored tensors' regions
        # NIXL metadata already made for a tuple of those regions (a context pulled again with the
        # same plan); cleared whenever a registration goes, whose remote key it carries
        self._granted: dict[tuple[tuple[int, int], ...], bytes] = {}
        self._regs_lock = asyncio.Lock()

    place = staticmethod(as_is)

    async def start(self) -> str:
        """Listen on the configured host only (`ControlListener`); return "host:port"."""
        self._agent = Agent("nixl-sender")
        await self._agent.start()
        address, bound = await self._listener.start(self._host, self._port)
        log.info("nixl_server_started", agent=self._agent.name, bound=bound[0], port=bound[1])
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        agent = self._agent
        assert agent is not None  # connections are accepted only after start()
        try:
            async with slot.waiting():
                await frames.recv(reader, NixlConnect, HANDSHAKE_S)
            info = await agent.call(agent.metadata, [], True)  # connection info, no memory
            await frames.send(writer, NixlAgentInfo(metadata=info))
            while True:
                async with slot.waiting():
                    data = await frames.read_frame(reader, MAX_REQUEST_BYTES)
                grant, held, payloads, release = await self._grant(data)
                try:
                    await frames.send(writer, grant)
                    if not grant.response.error:
                        await frames.recv(reader, NixlDone, HOLD_S)
                        slot.pulled()
                finally:
                    try:
                        await self._release(held)  # while `payloads` (per-pull copies) still live
                    finally:
                        release()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the receiver closed or dropped the connection: what it held is released above
        except SlotEnded:
            raise  # its deadline passed or a newcomer took its slot: counted and logged there
        except Exception as e:  # a bad peer or a NIXL failure ends this connection, never the server
            log.warning("nixl_connection_dropped", peer=str(writer.get_extra_info("peername")),
                        error=f"{type(e).__name__}: {e}")

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

        response, payloads, release = answer(request, lookup, self._authorize, self._pin, checksums=False)
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
            if lapsed:
                self._granted.clear()  # their remote keys die with them
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

            key = tuple(r.region for r in held)
            cached = self._granted.get(key) if not lapsed and not new else None
            if cached is not None:  # every region registered already, its metadata made before: no hop
                return held, cached

            def register() -> bytes:
                _deregister(agent, lapsed)
                for reg in new:
                    reg.descs = agent.register([reg.region])
                regions = [r.region for r in held]
                return agent.metadata(regions, False) if regions else b""

            try:
                granted = await agent.call(register)
                if all(r.owner is not None for r in held):  # stored tensors' registrations only: reusable
                    if len(self._granted) >= GRANTED_CACHE:
                        self._granted.pop(next(iter(self._granted)))
                    self._granted[key] = granted
                return held, granted
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
            if lapsed:
                self._granted.clear()  # their remote keys die with them
                if self._agent is not None:
                    await self._agent.call(_deregister, self._agent, lapsed)

    async def close(self) -> None:
        await self._listener.close()
        if self._agent is not None:
            await self._agent.call(_deregister, self._agent, list(self._regs.values()))
            self._regs.clear()
            self._granted.clear()
            self._agent.close()
            self._agent = None


def _nothing() -> None:
    """The release of a pull that holds nothing."""


def _deregister(agent: Agent, regs: list[_Registration]) -> None:
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
