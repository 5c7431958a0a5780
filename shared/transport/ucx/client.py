"""The UCX channel's receiver side (`UcxBulkClient`): pulls over cached connections.

A connection is a TCP stream to the sender, dialled ahead (`warm`) or by its first pull, which
wires up the endpoint (`wireup.py`): the hello carries that pull's request, the sender's welcome
either refuses it or names the worker address of the connection's sandbox (checked before ucxx
sees it), and the response comes over the new endpoint. Every later pull sends its request over
the endpoint as one object message. Then: the `PullResponse` (its size bounded before a buffer
exists), the headers checked against the caller's buffers (`bulk.landings`), then one tagged
receive per payload, all posted at once in request order (UCX matches same-tag messages in
order), so the wire stays busy with no per-item round trip; items are handed to `on_item` as each
lands. Before UCX writes into CUDA buffers the client waits, off the loop, for the work queued on
their stream (`settle`). Runs on the receiver's event loop; the skeleton (cache, locks, the error
contract) is `client.py`'s.

Connect deadlines: a connect to a dead sender's port can hang, so the dial has a deadline of its
own: SUSPECT_CONNECT_S where the address just failed (its endpoint broke, or a connect to it
failed: a SIGKILLed sender is bypassed within it), CONNECT_S otherwise (a first connect to a live
sender on a loaded host can take longer than the suspect deadline, and a false "unreachable"
would open the holder's circuit). For RETRY_AFTER_S after a failed connect, pulls from that
address fail at once instead of each waiting out its own connect. A welcome that is malformed or
names a malformed address fails the pull like a refusal.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from droidmesh.shared.errors import BadMessageError, PeerUnreachableError, TransferError
from droidmesh.shared.transport.address import on_this_host, parse_host_port
from droidmesh.shared.transport.bulk import OnItem, land_async, landings
from droidmesh.shared.transport.client import ChannelClient
from droidmesh.shared.transport.ucp_address import check_peer
from droidmesh.shared.transport.ucx import ops, runtime, wireup
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("ucx")
CONNECT_S = 5.0
SUSPECT_CONNECT_S = 0.5
RETRY_AFTER_S = 1.0


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.ep: Any = None  # the endpoint, once the first pull has wired it up


def ucx_buffer(t: torch.Tensor) -> Any:
    """What ucxx receives into: a CUDA tensor as itself (`__cuda_array_interface__`), host memory
    as a numpy view."""
    return t if t.device.type == "cuda" else t.numpy()


async def settle(buffers: Sequence[torch.Tensor]) -> None:
    """Wait, on a worker thread, for the work queued so far on each CUDA buffer's current stream:
    the caching allocator may hand out memory that kernels queued before the pull still use, and
    UCX's copies are not ordered with that stream."""
    for device in {b.device for b in buffers if b.device.type == "cuda"}:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        await asyncio.to_thread(done.synchronize)


class UcxBulkClient(ChannelClient[_Connection]):
    """Pulls over cached connections (one per sender address, one pull at a time each)."""

    transport: Transport = "ucx"

    def __init__(self) -> None:
        super().__init__()
        self._unreachable: dict[str, tuple[float, str]] = {}  # address -> (monotonic time, why) of a failed connect
        self._suspect: set[str] = set()  # addresses whose endpoint broke or whose connect failed

    async def _pull_on(self, conn: _Connection, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem) -> int:
        request = runtime.ask_device(request, into)
        if conn.ep is None:
            conn.ep = await self._wire(conn, request)
        else:
            await ops.send_obj(conn.ep, schemas.encode(request))
        ep = conn.ep
        response = schemas.decode(await ops.recv_frame(ep, schemas.MAX_MESSAGE_BYTES), schemas.PullResponse)
        lands = landings(request, response, into)
        await settle([land.recv for land in lands])
        # Each receive's task holds its buffer until UCX is done with it (`ops`): on an early exit
        # the caller drops (aborts) the endpoint, and the receives end as cancelled.
        receives = [ops.op(ep.recv(ucx_buffer(land.recv))) for land in lands]
        for land, received in zip(lands, receives, strict=True):
            await asyncio.shield(received)  # in order: E first, so the engine can start while the rest streams
            on_item(land.item, await land_async(land))  # decoded on a thread (`land_async`)
            await asyncio.sleep(0)  # items that have all arrived are verified one hold of the loop each
        return sum(land.header.nbytes for land in lands)

    async def _wire(self, conn: _Connection, request: PullRequest) -> Any:
        """The hello with `request`, the welcome, the endpoint to the sandbox it names."""
        u, local = runtime.ucxx(), runtime.local_view()
        tag = secrets.randbits(64)
        conn.writer.write(wireup.hello(tag, u.get_worker_address().tobytes(), schemas.encode(request)))
        await conn.writer.drain()
        welcome = await wireup.read_welcome(conn.reader)
        if welcome.error:
            raise TransferError(f"sender refused the pull: {welcome.error}")
        try:
            check_peer(welcome.address, local, on_this_host(conn.writer.get_extra_info("peername")))
        except BadMessageError as e:
            log.warning("ucx_peer_refused", reason=str(e))
            raise
        ep = await wireup.endpoint_to(u, welcome.address, welcome.tag, tag, conn.writer)
        ep._droidmesh_watch = asyncio.ensure_future(wireup.watch(conn.reader, ep))  # referenced while the endpoint is
        return ep

    async def warm(self, address: str) -> None:
        """Start UCX here ahead of the first pull (the sender wires a connection up only with a
        granted pull, and drops a silent one within seconds: no connection is opened ahead)."""
        parse_host_port(address, "ucx")
        runtime.local_view()

    def _alive(self, conn: _Connection) -> bool:
        return not conn.reader.at_eof() and not conn.writer.is_closing() and (conn.ep is None or not conn.ep.closed)

    async def _connect(self, address: str) -> _Connection:
        """A TCP connection to the sender within CONNECT_S (SUSPECT_CONNECT_S for an address that
        just failed); an address whose connect failed in the last RETRY_AFTER_S fails at once
        (`PeerUnreachableError`)."""
        failed = self._unreachable.get(address)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_S:
            raise PeerUnreachableError(f"{address} unreachable {time.monotonic() - failed[0]:.2f}s ago: {failed[1]}")
        host, port = parse_host_port(address, "ucx")
        runtime.local_view()  # our own address must be readable before any peer's is trusted to UCX
        limit = SUSPECT_CONNECT_S if address in self._suspect else CONNECT_S
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), limit)
        except Exception as e:
            why = f"no connection within {limit}s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            self._unreachable[address] = (time.monotonic(), why)
            self._suspect.add(address)
            raise PeerUnreachableError(f"connect to {address} failed: {why}") from e
        self._unreachable.pop(address, None)
        self._suspect.discard(address)
        return _Connection(reader, writer)

    async def _disconnect(self, address: str, conn: _Connection) -> None:
        """Abort `address`'s endpoint (it failed, or the client closes): a reconnect is suspect."""
        self._suspect.add(address)
        ops.abort(conn.ep)
        conn.writer.close()
