"""The UCX channel's receiver side (`UcxBulkClient`): pulls over cached endpoints.

One pull: the request as one object message, the `PullResponse` (its size bounded before a buffer
exists), the headers checked against the caller's buffers (`bulk.landings`), then one tagged
receive per payload, all posted at once in request order (UCX matches same-tag messages in order),
so the wire stays busy with no per-item round trip; items are handed to `on_item` as each lands.
Before UCX writes into CUDA buffers the client waits, off the loop, for the work queued on their
stream (`ops.settle`). Runs on the receiver's event loop; the skeleton (cache, locks, the error
contract) is `client.py`'s.

Connect deadlines: ucxx takes ~5 s to report a connect to a closed port, so a connect has a
deadline of its own: SUSPECT_CONNECT_S where the address just failed (its endpoint broke, or a
connect to it failed: a SIGKILLed sender is bypassed within it), CONNECT_S otherwise (a first
connect to a live sender on a loaded host can take longer than the suspect deadline, and a false
"unreachable" would open the holder's circuit). For RETRY_AFTER_S after a failed connect, pulls
from that address fail at once instead of each waiting out its own connect. A sender whose hello
is malformed fails the connect like an unreachable one (`wireup.connect` checks it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch

from droidmesh.shared.errors import PeerUnreachableError
from droidmesh.shared.transport.address import parse_host_port
from droidmesh.shared.transport.bulk import OnItem, landings
from droidmesh.shared.transport.client import ChannelClient
from droidmesh.shared.transport.ucx import ops, runtime, wireup
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, Transport

CONNECT_S = 5.0
SUSPECT_CONNECT_S = 0.5
RETRY_AFTER_S = 1.0


class UcxBulkClient(ChannelClient[Any]):
    """Pulls over cached endpoints (one per sender address, one pull at a time each)."""

    transport: Transport = "ucx"

    def __init__(self) -> None:
        super().__init__()
        self._unreachable: dict[str, tuple[float, str]] = {}  # address -> (monotonic time, why) of a failed connect
        self._suspect: set[str] = set()  # addresses whose endpoint broke or whose connect failed

    async def _pull_on(self, ep: Any, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem) -> int:
        request = runtime.ask_device(request, into)
        await ops.send_obj(ep, schemas.encode(request))
        response = schemas.decode(await ops.recv_frame(ep, schemas.MAX_MESSAGE_BYTES), schemas.PullResponse)
        lands = landings(request, response, into)
        await ops.settle([land.recv for land in lands])
        # Each receive's task holds its buffer until UCX is done with it (`ops`): on an early exit
        # the caller drops (aborts) the endpoint, and the receives end as cancelled.
        receives = [ops.op(ep.recv(ops.ucx_buffer(land.recv))) for land in lands]
        for land, received in zip(lands, receives, strict=True):
            await asyncio.shield(received)  # in order: E first, so the engine can start while the rest streams
            on_item(land.item, land.land())
        return sum(land.header.nbytes for land in lands)

    def _alive(self, ep: Any) -> bool:
        return not ep.closed

    async def _connect(self, address: str) -> Any:
        """A new endpoint connected within CONNECT_S (SUSPECT_CONNECT_S for an address that just
        failed); an address whose connect failed in the last RETRY_AFTER_S fails at once
        (`PeerUnreachableError`)."""
        failed = self._unreachable.get(address)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_S:
            raise PeerUnreachableError(f"{address} unreachable {time.monotonic() - failed[0]:.2f}s ago: {failed[1]}")
        parse_host_port(address, "ucx")
        # The connect runs as its own task: on a timeout it is left to finish and whatever it
        # made is aborted then (a refused TCP connect, a dead sender's, fails at once).
        connecting = asyncio.ensure_future(wireup.connect(address))
        limit = SUSPECT_CONNECT_S if address in self._suspect else CONNECT_S
        try:
            ep = await asyncio.wait_for(asyncio.shield(connecting), limit)
        except BaseException as e:
            connecting.add_done_callback(_abort_made)
            why = f"no connection within {limit}s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            if isinstance(e, Exception):
                self._unreachable[address] = (time.monotonic(), why)
                self._suspect.add(address)
                raise PeerUnreachableError(f"connect to {address} failed: {why}") from e
            raise
        self._unreachable.pop(address, None)
        self._suspect.discard(address)
        return ep

    async def _disconnect(self, address: str, ep: Any) -> None:
        """Abort `address`'s endpoint (it failed, or the client closes): a reconnect is suspect."""
        self._suspect.add(address)
        ops.abort(ep)


def _abort_made(connecting: asyncio.Future) -> None:
    """A connect given up on that completed later: abort the endpoint it made."""
    if not connecting.cancelled() and connecting.exception() is None:
        ops.abort(connecting.result())
