"""The bulk channel: per-layer tensors peer to peer, never through the bus.

Two narrow roles, each a coroutine API on the owning service's event loop (none blocks the loop):
  `BulkServer` (sender)    `start()` listens and returns the address receivers dial (announced
                           in `CacheAvailable` with the channel's `transport` name); `close()`.
  `BulkClient` (receiver)  `pull(address, request, into, on_item, timeout_s)` pulls the request's
                           items, in order, into the caller's buffers `into` (their shape, dtype and
                           device say what the receiver expects) and calls `on_item(item, tensor)`
                           on the loop as each one lands; `warm(address)`; `close()`.
Implementations: `ucx` (`shared/transport/ucx.py`, real processes) and `inproc`
(`shared/transport/inproc.py`, one process, no sockets: tests drive the receiver with it).
`make_server` / `make_client` pick one by name; the UCX module is imported only when asked for.

Every channel runs the same protocol, so its checks live here, once:
  1. the client sends one `PullRequest` (items in the order it wants them: E first);
  2. the server authorizes it (capability token), looks every item up in its store, encodes each
     with the requested codec (or `raw` when it lacks that codec) and answers one `PullResponse`
     with every item's `TensorHeader` up front, then sends the payloads in order;
  3. the client checks every header against its own buffer (context, layer, kind, shape, dtype),
     that the codec is registered here and that the payload is no larger than that codec's
     bound for the buffer, all before receiving a byte; then, per landed payload, verifies the
     checksum and decodes into the buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog
import torch

from droidmesh.shared.device import dtype_name
from droidmesh.shared.errors import DroidMeshError, IntegrityError, TransferError
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire.schemas import PullItem, PullRequest, PullResponse, TensorHeader, Transport

log = structlog.get_logger("bulk")

# (context_id, layer, kind) -> the stored tensor, or None when the sender does not hold it.
TensorLookup = Callable[[str, int, str], "torch.Tensor | None"]
# Raises (e.g. `UnauthorizedError`) to refuse a pull.
Authorize = Callable[[PullRequest], None]
# Called on the client's event loop as each item lands, in request order.
OnItem = Callable[[PullItem, torch.Tensor], None]


class BulkServer(Protocol):
    transport: Transport

    async def start(self) -> str: ...

    async def close(self) -> None: ...


class BulkClient(Protocol):
    transport: Transport

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int: ...

    async def warm(self, address: str) -> None: ...

    async def close(self) -> None: ...


TRANSPORTS: tuple[Transport, ...] = ("ucx", "inproc", "nixl")


def make_server(transport: str, lookup: TensorLookup, authorize: Authorize | None, *, host: str = "127.0.0.1",
                port: int = 0, name: str = "") -> BulkServer:
    """The sender's server for `transport` (ucx listens on host:port; inproc registers `name`)."""
    if transport == "ucx":
        from droidmesh.shared.transport.ucx import UcxBulkServer

        return UcxBulkServer(lookup, authorize, host=host, port=port)
    if transport == "nixl":
        from droidmesh.shared.transport.nixl import NixlBulkServer

        return NixlBulkServer(lookup, authorize, host=host, port=port)
    if transport == "inproc":
        from droidmesh.shared.transport.inproc import InProcessBulkServer

        return InProcessBulkServer(lookup, authorize, name=name)
    raise TransferError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")


def make_client(transport: str) -> BulkClient:
    if transport == "ucx":
        from droidmesh.shared.transport.ucx import UcxBulkClient

        return UcxBulkClient()
    if transport == "nixl":
        from droidmesh.shared.transport.nixl import NixlBulkClient

        return NixlBulkClient()
    if transport == "inproc":
        from droidmesh.shared.transport.inproc import InProcessBulkClient

        return InProcessBulkClient()
    raise TransferError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")


# -- server side ------------------------------------------------------------------------------
def answer(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None
           ) -> tuple[PullResponse, list[torch.Tensor]]:
    """The response to `request` and the payloads to send after it, in item order. A refusal
    (unauthorized, unknown item) is a response with `error` and no payloads."""
    try:
        if authorize is not None:
            authorize(request)
        tensors = []
        for item in request.items:
            t = lookup(request.context_id, item.layer, item.kind)
            if t is None:
                raise TransferError(f"sender does not hold {request.context_id} layer {item.layer} {item.kind}")
            tensors.append(t)
    except DroidMeshError as e:
        log.warning("pull_refused", code=e.code, error=str(e))
        return PullResponse(headers=[], error=f"{e.code}: {e}"), []
    codec = _server_codec(request.codec)
    headers, payloads = [], []
    for item, t in zip(request.items, tensors, strict=True):
        payload, params = codec.encode(t, request.codec_params)
        headers.append(TensorHeader(context_id=request.context_id, layer=item.layer, kind=item.kind,
                                    shape=list(t.shape), dtype=dtype_name(t.dtype), codec=codec.name,
                                    codec_params=params, nbytes=payload.numel(),
                                    checksum=_payload_checksum(t, payload)))
        payloads.append(payload)
    return PullResponse(headers=headers), payloads


# A stored tensor is never written after capture, so the checksum of its own bytes (the raw
# payload) is computed on its first pull only: id(tensor) -> checksum, dropped with the tensor.
_STORED_SUMS: dict[int, str] = {}


def _payload_checksum(t: torch.Tensor, payload: torch.Tensor) -> str:
    if payload.data_ptr() != t.data_ptr() or payload.numel() != t.numel() * t.element_size():
        return codecs.checksum(payload)  # encoded afresh for this pull
    key = id(t)
    known = _STORED_SUMS.get(key)
    if known is None:
        known = _STORED_SUMS[key] = codecs.checksum(payload)
        weakref.finalize(t, _STORED_SUMS.pop, key, None)
    return known


def _server_codec(name: str) -> codecs.Codec:
    try:
        return codecs.get(name)
    except IntegrityError:  # a codec this sender lacks: raw is always understood
        return codecs.get("raw")


# -- client side ------------------------------------------------------------------------------
@dataclasses.dataclass
class Landing:
    """Where one item's payload is received (`codecs.receive_buffer`): straight into the caller's
    buffer, or into a staging buffer that is decoded into it."""

    item: PullItem
    header: TensorHeader
    codec: codecs.Codec
    out: torch.Tensor  # the caller's buffer
    recv: torch.Tensor  # uint8 [header.nbytes]: `out`'s own bytes or a staging buffer (host, pinned or device)

    def land(self) -> torch.Tensor:
        """Verify the received payload and decode it into `out`; return `out`."""
        got = codecs.checksum(self.recv)
        if got != self.header.checksum:
            raise IntegrityError(f"checksum mismatch for layer {self.item.layer} {self.item.kind}: "
                                 f"{got} != {self.header.checksum}")
        self.codec.decode(self.recv, self.header, self.out)
        return self.out


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
        if codecs.asks_device(header.codec_params) and not codecs.asks_device(request.codec_params):
            raise IntegrityError(f"layer {item.layer} {item.kind}: a device payload this receiver did not ask for")
        out.append(Landing(item, header, codec, buf, codecs.receive_buffer(codec, header, buf)))
    return out


async def guarded_pull(address: str, timeout_s: float, lock: asyncio.Lock, pull: Callable[[], Awaitable[int]],
                       drop: Callable[[], Awaitable[None]]) -> int:
    """The error contract of every networked `BulkClient.pull`: one pull at a time per address
    (`lock`), `timeout_s` over all of it, and on any error `drop` the connection (never reused
    half-read). DroidMesh errors pass as they are; the deadline and anything else become a
    `TransferError` naming the address."""
    async with lock:
        try:
            async with asyncio.timeout(timeout_s):
                return await pull()
        except (DroidMeshError, asyncio.CancelledError):
            await drop()
            raise
        except TimeoutError:
            await drop()
            raise TransferError(f"pull from {address} exceeded {timeout_s:.3g}s") from None
        except Exception as e:
            await drop()
            raise TransferError(f"pull from {address} failed: {type(e).__name__}: {e}") from e
