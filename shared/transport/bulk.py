"""The bulk channel: per-layer tensors peer to peer, never through the bus.

Two narrow roles, each a coroutine API on the owning service's event loop (none blocks the loop):
  `BulkServer` (sender)    `start()` listens and returns the address receivers dial (announced
                           in `CacheAvailable` with the channel's `transport` name); `close()`;
                           `place(tensors)` (blocking, the sender's torch thread, once per
                           context before it is stored) returns them where the channel serves
                           them from: `shm` moves them into sealed shared memory, the others
                           return them as they are.
  `BulkClient` (receiver)  `pull(address, request, into, on_item, timeout_s)` pulls the request's
                           items, in order, into the caller's buffers `into` (their shape, dtype and
                           device say what the receiver expects) and calls `on_item(item, tensor)`
                           on the loop as each one lands; `warm(address)`; `close()`.
Implementations: `ucx` (`shared/transport/ucx/`), `nixl` (`nixl/`) and `shm` (`shm/`, one host)
between real processes, and `inproc` (`inproc.py`, one process, no sockets: tests drive the
receiver with it). The networked clients share one skeleton (`client.py`).
`make_server` / `make_client` (`registry.py`, re-exported here) pick one by name and import only
that channel's module.

Every channel runs the same protocol:
  1. the client sends one `PullRequest` (items in the order it wants them: E first);
  2. the server authorizes it (a single-use grant, `tokens.py`), looks every item up in its store,
     encodes each with the requested codec (or `raw` when it lacks that codec) and answers one
     `PullResponse` with every item's `TensorHeader` up front, then sends the payloads in order
     (`answer.py`: the sender's side, and its checks);
  3. the client checks every header against its own buffer (context, layer, kind, shape, dtype),
     that the codec is registered here and that the payload is no larger than that codec's
     bound for the buffer, all before receiving a byte; then, per landed payload, verifies the
     checksum and decodes into the buffer (`landings`, here), on a decoding thread when that
     costs time (`land_async`).

Peers are not trusted, so neither side allocates from what the other declares: the server's
checks are in `answer.py`; the client's buffers are the caller's, sized from its own prompt and
model (`pull.py`), a header must match them exactly, and staging is allocated only within the
codec's bound for that buffer (`landings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.kv import streams
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.transport import codecs, integrity, placement, workers
from droidmesh.shared.transport.limits import (  # the limits every request meets, re-exported: callers import them here
    MAX_CODEC_PARAMS as MAX_CODEC_PARAMS,
)
from droidmesh.shared.transport.limits import MAX_ITEMS as MAX_ITEMS
from droidmesh.shared.transport.limits import MAX_LAYERS as MAX_LAYERS
from droidmesh.shared.transport.limits import MAX_REQUEST_BYTES as MAX_REQUEST_BYTES
from droidmesh.shared.transport.limits import MAX_STR as MAX_STR
from droidmesh.shared.transport.limits import MAX_TOKENS as MAX_TOKENS
from droidmesh.shared.transport.registry import TRANSPORTS as TRANSPORTS  # the factories live there; callers import them here
from droidmesh.shared.transport.registry import make_client as make_client
from droidmesh.shared.transport.registry import make_server as make_server
from droidmesh.shared.wire.schemas import PullItem, PullRequest, PullResponse, TensorHeader, Transport

# (context_id, layer, kind) -> the stored tensor, or None when the sender does not hold it.
TensorLookup = Callable[[str, int, str], "torch.Tensor | None"]
# Raises (e.g. `UnauthorizedError`) to refuse a pull; returns the grantee (the NATS user the grant
# went to, "" or None where unknown), whose connections the server's slots cap.
Authorize = Callable[[PullRequest], "str | None"]
# Called on the client's event loop as each item lands, in request order.
OnItem = Callable[[PullItem, torch.Tensor], None]


class PullHold(Protocol):
    """One pull's hold on a context's stored tensors (the sender's store implements it)."""

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` of per-pull copies; raise `TransferError` past the pull budget."""

    def refund(self, nbytes: int) -> None: ...

    def release(self) -> None:
        """The pull is over (idempotent): its copies and pinned tensors stop counting."""


# context_id -> a hold for one pull, taken only after the pull is authorized.
Pin = Callable[[str], PullHold]

class BulkServer(Protocol):
    transport: Transport

    async def start(self) -> str: ...

    def place(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    async def close(self) -> None: ...


class BulkClient(Protocol):
    transport: Transport

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int: ...

    async def warm(self, address: str) -> None: ...

    async def close(self) -> None: ...


def as_is(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`BulkServer.place` of a channel that serves tensors from wherever they are."""
    return list(tensors)


def token_axis(kind: str) -> int:
    """The token axis of a stored item: E [1, T, D] -> 1, K / V [1, kvh, T, hd] -> 2."""
    return 1 if kind == "E" else 2


# -- client side ------------------------------------------------------------------------------
@dataclasses.dataclass
class Landing:
    """Where one item's payload is received (`placement.receive_place`): straight into the caller's
    buffer, or into a staging buffer that is decoded into it."""

    item: PullItem
    header: TensorHeader
    codec: codecs.Codec
    out: torch.Tensor  # the caller's buffer
    place: placement.Place
    staged: torch.Tensor | None = None  # the receive buffer once made (given here, or made at first use of `recv`)

    @property
    def recv(self) -> torch.Tensor:
        """uint8 [header.nbytes]: `out`'s own bytes or a staging buffer (host, pinned or device),
        made at first use (a channel that copies by address into `out` never needs the view)."""
        if self.staged is None:
            self.staged = placement.buffer_at(self.place, self.header, self.out)
        return self.staged

    @property
    def in_place(self) -> bool:
        """The payload is received as `out`'s own bytes (raw, contiguous, the size `out` is)."""
        return self.place == "out"

    def land(self, verify: bool = True) -> torch.Tensor:
        """Verify the received payload (unless the channel has nothing to verify: no wire) and
        decode it into `out`, both on the copy stream for a CUDA `out` (`streams.landing`: this
        thread waits for them, the compute stream does not); return `out`, ready to use. A raw
        payload received in place with nothing to verify is `out` already (a channel's own device
        copy into it waited for itself)."""
        if self.in_place and not verify:
            return self.out
        with streams.landing(self.out.device):
            if verify:
                got = integrity.checksum(self.recv)
                if got != self.header.checksum:
                    raise IntegrityError(f"checksum mismatch for layer {self.item.layer} {self.item.kind}: "
                                         f"{got} != {self.header.checksum}")
            self.codec.decode(self.recv, self.header, self.out)
        return self.out

    def costs_time(self, verify: bool = True) -> bool:
        """Landing decodes (a staged payload: dequantized or copied into `out`) or waits on a device
        (a CUDA buffer's copy stream, a device checksum's read back). A host payload received in
        place is only hashed: xxh3 holds the GIL at ~25 GB/s, so a thread would not free the loop."""
        return not self.in_place or (verify and self.out.device.type == "cuda")


async def land_async(land: Landing, verify: bool = True) -> torch.Tensor:
    """`land.land(verify)` for a client on an event loop: on a decoding thread when it costs time,
    so the loop keeps streaming other requests' tokens meanwhile; else on the loop (a thread hop
    would cost more). Cancelled, it returns once the thread is done with the caller's buffer
    (`workers.run_settled`): it is written no more once its pull has ended."""
    if not land.costs_time(verify):
        return land.land(verify)
    return await workers.run_settled(workers.decoders(), land.land, verify)


def landings(request: PullRequest, response: PullResponse, into: Sequence[torch.Tensor]) -> list[Landing]:
    """Check the response against the request and the caller's buffers; allocate only what a
    checked header allows. Raises `TransferError` (refused) or `IntegrityError` (mismatch)."""
    if response.error:
        raise TransferError(f"sender refused the pull: {response.error}")
    if len(into) != len(request.items):
        raise ValueError(f"{len(into)} buffers for {len(request.items)} items")
    if len(response.headers) != len(request.items):
        raise IntegrityError(f"{len(response.headers)} headers for {len(request.items)} items")
    out = []
    for item, header, buf in zip(request.items, response.headers, into, strict=True):
        want = (request.context_id, item.layer, item.kind, list(buf.shape), dtype_name(buf.dtype))
        got = (header.context_id, header.layer, header.kind, list(header.shape), header.dtype)
        if got != want:
            raise IntegrityError(f"header {got} does not match the expected layout {want}")
        codec = codecs.get(header.codec)
        bound = codec.max_nbytes(tuple(buf.shape), buf.dtype, header.codec_params)
        if not 0 <= header.nbytes <= bound:
            raise IntegrityError(f"layer {item.layer} {item.kind}: {header.nbytes} encoded bytes, "
                                 f"{header.codec} allows at most {bound}")
        if codecs.asks_device(header.codec_params) and not (codecs.asks_device(request.codec_params)
                                                            or request.device_exports):
            raise IntegrityError(f"layer {item.layer} {item.kind}: a device payload this receiver did not ask for")
        out.append(Landing(item, header, codec, buf, placement.receive_place(codec, header, buf)))
    return out
