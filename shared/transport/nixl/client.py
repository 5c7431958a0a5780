"""The NIXL channel's receiver side (`NixlBulkClient`): one-sided reads of the sender's registered
memory, which the receiver's agent performs straight into its own buffers.

A connection is a TCP stream to the sender (dialled within CONNECT_S); the sender describes
nothing of itself before a granted pull. Per pull: `PullRequest` -> `NixlGrant`; the headers are
checked (`bulk.landings`), the grant's metadata too (`metadata.check_grant`: one agent's
host-memory descriptors, each remote key as UCX will walk it; the connection's first grant also
carries that agent's connection info, its worker address checked), then one call on the agent's
thread loads it (and, the first time, connects to that agent: the sender's sandbox process for
this connection), registers the landing buffers (the caller's own for raw on the CPU) and posts
the READs: the first layer's items alone (E items lead a plan), then whole layers gathered
up to READ_BYTES; as each completes, in request order, its items are decoded and handed to
`on_item`. `NixlDone` then lets the sender release
the pull.

No checksums: a READ copies the sender's own registered memory, which it pins unchanged for the
pull, straight into ours (CMA on one host; RDMA, whose link CRC covers it, across hosts): there
is no stream of ours to corrupt, as with shm's sealed memory. Hashing every byte on both sides
cost about a third of a pull's time. A grant's metadata stays loaded while its connection lives (capability is
checked when a pull is granted, not per READ); dropping the connection forgets it.

With UCX on one host a READ is a CMA copy done inside the post call with the GIL released, so the
bytes never run on the event loop; where a post returns in progress (a network transport), the
loop polls the state with short sleeps (`_POLL_S`). NIXL's own descriptor serialization is pickle;
nothing here unpickles a peer's bytes (regions travel as typed fields).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from droidmesh.shared.errors import BadMessageError, TransferError
from droidmesh.shared.transport.address import on_this_host, parse_host_port
from droidmesh.shared.transport.bulk import Landing, OnItem, land_async, landings
from droidmesh.shared.transport.client import ChannelClient
from droidmesh.shared.transport.nixl import frames, metadata
from droidmesh.shared.transport.nixl.agent import Agent
from droidmesh.shared.transport.ucp_address import LocalView
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import NixlDone, NixlGrant, NixlRegion
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("nixl")
CONNECT_S = 10.0  # dialling a sender
READ_BYTES = 4 << 20  # layers gathered into one READ up to about this many bytes (`_batches`)
_POLL_S = (0.00005, 0.001)  # in-progress transfer: first and longest sleep between state checks


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_this_host: bool):
        self.reader, self.writer, self.on_this_host = reader, writer, on_this_host
        self.peer: metadata.PeerAgent | None = None  # the sandbox agent the first grant named


def _batches(moves: list[tuple[Landing, NixlRegion]]) -> list[list[tuple[Landing, NixlRegion]]]:
    """The READs of a pull, in order: the first layer's items alone (E leads a plan: the engine
    starts on it), then whole layers (a layer's K and V together) gathered until a READ moves at
    least READ_BYTES: a post costs tens of microseconds, a small layer less than that to copy."""
    runs = [list(run) for _, run in itertools.groupby(moves, key=lambda m: m[0].item.layer)]
    out: list[list[tuple[Landing, NixlRegion]]] = []
    size = READ_BYTES  # the first run starts a READ of its own
    for run in runs:
        if size >= READ_BYTES:
            out.append([])
            size = 0 if out[1:] else READ_BYTES
        out[-1] += run
        size += sum(r.nbytes for _, r in run)
    return out


def _release_reads(agent: Agent, handles: list[Any], registered: list[Any]) -> None:
    """On the agent's thread: release a pull's remaining transfers, then its landing buffers."""
    try:
        for handle in handles:
            agent.release(handle)
    finally:
        for descs in registered:
            agent.deregister(descs)


class NixlBulkClient(ChannelClient[_Connection]):
    """Pulls over cached connections (one per sender address, one pull at a time each)."""

    transport: Transport = "nixl"

    def __init__(self) -> None:
        super().__init__()
        self._agent: Agent | None = None
        self._local: LocalView | None = None  # what our agent's UCX pairs a sender's address with

    async def _pull_on(self, conn: _Connection, request: PullRequest, into: Sequence[torch.Tensor],
                       on_item: OnItem) -> int:
        await frames.send(conn.writer, request)
        grant = schemas.decode(await frames.read_frame(conn.reader), NixlGrant)
        lands = landings(request, grant.response, into)
        if [r.nbytes for r in grant.regions] != [land.header.nbytes for land in lands]:
            raise TransferError(f"grant regions {[r.nbytes for r in grant.regions]} do not match the headers")
        agent, local = self._agent, self._local
        assert agent is not None and local is not None
        if not any(r.nbytes for r in grant.regions):
            await frames.send(conn.writer, NixlDone())
            return 0
        try:
            peer, _ = metadata.check_grant(grant.metadata, local, conn.on_this_host, conn.peer)
        except BadMessageError as e:
            log.warning("nixl_peer_refused", reason=str(e))
            raise
        first = conn.peer is None
        if first and any(c.peer is not None and c.peer.name == peer.name for c in self._conns.values()):
            raise BadMessageError(f"NIXL agent {peer.name[:80]!r} already serves another connection")
        conn.peer = peer
        in_flight: list[Any] = []  # transfer handles posted but not done when posted
        registered: list[Any] = []  # the landing buffers' registration, once made
        try:
            await self._read(agent, peer.name if first else None, grant.metadata, lands, grant.regions, on_item,
                             in_flight, registered, peer.name)
        finally:
            if in_flight or registered:  # not released by the posts (a READ in progress, a failure): queued behind them
                await asyncio.shield(agent.call(_release_reads, agent, in_flight, registered))
        await frames.send(conn.writer, NixlDone())
        return sum(land.header.nbytes for land in lands)

    async def _read(self, agent: Agent, connect: str | None, granted: bytes, lands: list[Landing],
                    regions: list[NixlRegion], on_item: OnItem, in_flight: list[Any], registered: list[Any],
                    peer: str) -> None:
        """One call on the agent's thread loads the grant's metadata (connecting to agent `connect`
        first time), registers the landing buffers and posts the READs (`_batches`), in order, settling each one's future on the loop as its
        post returns (no round trip to the agent's thread per item); each READ's items are
        delivered as it completes, in request order."""
        loop = asyncio.get_running_loop()
        batches = _batches(list(zip(lands, regions, strict=True)))
        posted: list[asyncio.Future[tuple[Any, str]]] = [loop.create_future() for _ in batches]
        abandoned = threading.Event()

        def settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        def post_all() -> None:  # on the agent's thread
            i = 0
            try:
                local = [(land.recv.data_ptr(), land.recv.numel()) for land, r in zip(lands, regions, strict=True) if r.nbytes]
                if local:
                    name = agent.load(granted)  # the grant's regions join what is loaded for the sender
                    if name != peer:
                        raise BadMessageError(f"NIXL loaded agent {name[:80]!r}, not {peer!r}")
                    if connect is not None:
                        agent.connect(connect)
                    registered.append(agent.register(local))
                for i, batch in enumerate(batches):
                    if abandoned.is_set():
                        return
                    moving = [(land, r) for land, r in batch if r.nbytes]
                    result: tuple[Any, str] = (None, "DONE")
                    if moving:
                        handle, state = agent.read([(land.recv.data_ptr(), r.nbytes) for land, r in moving],
                                                   [(r.addr, r.nbytes) for _, r in moving], peer)
                        if state == "PROC":
                            in_flight.append(handle)
                            result = (handle, state)
                        else:
                            agent.release(handle)  # a same-host READ is done by now
                            result = (None, state)
                    if i == len(batches) - 1 and not in_flight:  # every READ done: no hop back here to release
                        _release_reads(agent, [], registered)
                        registered.clear()
                    loop.call_soon_threadsafe(settle, posted[i], result, None)
            except BaseException as e:  # this READ fails; the ones after it are never posted
                loop.call_soon_threadsafe(settle, posted[i], None, e)

        posting = asyncio.wrap_future(agent.submit(post_all))
        try:
            for batch, future in zip(batches, posted, strict=True):
                await self._complete(agent, *await future)
                await _deliver(batch, on_item)
        finally:
            abandoned.set()  # runs not yet posted are not
            await asyncio.shield(asyncio.gather(posting, return_exceptions=True))
            for future in posted:  # settled before `posting` ended; a failure after ours is not news
                if future.done() and not future.cancelled():
                    future.exception()

    @staticmethod
    async def _complete(agent: Agent, handle: Any, state: str) -> None:
        delay = _POLL_S[0]
        while state == "PROC":
            await asyncio.sleep(delay)
            delay = min(2 * delay, _POLL_S[1])
            state = await agent.call(agent.state, handle)
        if state != "DONE":
            raise TransferError(f"NIXL read failed ({state})")

    def _alive(self, conn: _Connection) -> bool:
        return not conn.reader.at_eof()

    async def warm(self, address: str) -> None:
        """Start this receiver's NIXL agent ahead of the first pull (the sender describes its own
        only with a granted pull, and drops a silent connection: no connection is opened ahead)."""
        parse_host_port(address, "nixl")
        await self._start_agent()

    async def _start_agent(self) -> None:
        if self._agent is None:
            agent = Agent("nixl-receiver")
            await agent.start()
            self._agent = agent
            own = await agent.call(agent.metadata, [], True)
            self._local = LocalView.of(metadata.own_address(own))

    async def _connect(self, address: str) -> _Connection:
        host, port = parse_host_port(address, "nixl")
        await self._start_agent()
        async with asyncio.timeout(CONNECT_S):
            reader, writer = await asyncio.open_connection(host, port)
        return _Connection(reader, writer, on_this_host(writer.get_extra_info("peername")))

    async def _disconnect(self, address: str, conn: _Connection) -> None:
        """Close the connection (the sender releases its grants) and forget the sender agent's
        metadata, so nothing it granted stays readable."""
        conn.writer.close()
        agent = self._agent
        if agent is not None and conn.peer is not None:
            try:
                await asyncio.shield(agent.call(agent.forget, conn.peer.name))
            except Exception as e:  # already gone on the agent's side: nothing left to forget
                log.debug("nixl_remove_remote_failed", peer=conn.peer.name, error=str(e))

    async def _shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None


async def _deliver(batch: list[tuple[Landing, NixlRegion]], on_item: OnItem) -> None:
    """A completed READ's items, in request order, each decoded on a thread (`land_async`): the
    loop streams other requests' tokens meanwhile."""
    for land, _ in batch:
        on_item(land.item, await land_async(land, verify=False))  # one-sided reads: see the module docstring
