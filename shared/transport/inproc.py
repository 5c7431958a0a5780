"""The in-process bulk channel: a sender and a receiver in one process, no sockets.

Tests drive the receiver's whole reuse path with it (pull, header checks, codecs, per-item
delivery while the engine computes) without UCX. Servers register under a name in a process-wide
table; the address a client dials is that name. Payloads are copied into the client's receive
buffers one item at a time, yielding to the loop between items, so items land one by one as
they would from a network; the protocol's checks are the same as UCX's (`bulk.py`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import torch

from droidmesh.shared.errors import TransferError
from droidmesh.shared.transport.bulk import Authorize, OnItem, Pin, TensorLookup, answer, landings
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, Transport

_SERVERS: dict[str, InProcessBulkServer] = {}
_names = itertools.count()


class InProcessBulkServer:
    transport: Transport = "inproc"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, name: str = "", pin: Pin | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self.name = name or f"inproc-{next(_names)}"

    async def start(self) -> str:
        if self.name in _SERVERS:
            raise TransferError(f"an in-process bulk server named {self.name!r} already runs")
        _SERVERS[self.name] = self
        return self.name

    def serve(self, request_bytes: bytes) -> tuple[bytes, list[torch.Tensor], Callable[[], None]]:
        """The encoded response, the payloads (exactly as a network server would send them) and
        the hold's release, called once the client has copied them."""
        request = schemas.decode(request_bytes, PullRequest)
        response, payloads, release = answer(request, self._lookup, self._authorize, self._pin)
        return schemas.encode(response), payloads, release

    async def close(self) -> None:
        _SERVERS.pop(self.name, None)


class InProcessBulkClient:
    transport: Transport = "inproc"

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull from the server registered as `address`; same contract as `UcxBulkClient.pull`."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._pull(address, request, into, on_item)
        except TimeoutError:
            raise TransferError(f"pull from {address} exceeded {timeout_s:.3g}s") from None

    async def _pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor],
                    on_item: OnItem) -> int:
        server = _SERVERS.get(address)
        if server is None:
            raise TransferError(f"no in-process bulk server at {address!r}")
        response_bytes, payloads, release = server.serve(schemas.encode(request))
        try:
            lands = landings(request, schemas.decode(response_bytes, schemas.PullResponse), into)
            for land, payload in zip(lands, payloads, strict=True):
                await asyncio.sleep(0)  # one item at a time, as from a network
                if payload.numel() != land.recv.numel():
                    raise TransferError(f"layer {land.item.layer} {land.item.kind}: sent {payload.numel()} bytes, "
                                        f"header said {land.recv.numel()}")
                land.recv.copy_(payload)
                on_item(land.item, land.land())
        finally:
            release()
        return sum(land.header.nbytes for land in lands)

    async def warm(self, address: str) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to release."""
