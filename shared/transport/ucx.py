"""UCX bulk channel (ucxx): senders serve per-layer tensors, receivers pull them peer-to-peer.

Control plane vs data plane, in order:
  1. (NATS) the sender publishes `CacheAvailable`: context id, fingerprint, dtype, per-layer
     byte sizes, E layers, and its UCX listener's host:port.
  2. (NATS) a receiver finds that holder through the broker and decides which items it needs.
  3. (UCX)  the receiver connects (one cached endpoint per sender) and sends one `PullRequest`
     listing the items in the order it wants them: the transition layers' E first, then the
     reused KV layers.
  4. (UCX)  the sender answers with one `PullResponse` carrying every item's `TensorHeader`
     (shape, dtype, nbytes, xxh3 checksum), then posts every tensor's bytes at once, in order,
     straight from its store (no staging copy, no per-item round trip).
  5. the receiver checks each header against the announced layout, allocates its own buffer
     per item, posts every receive at once (UCX matches same-tag messages in order), and as
     each lands verifies its checksum and hands it to the engine, so recompute starts on E
     while the KV layers are still streaming.
Roles: `BulkServer` (sender; `start` / `close`), `BulkClient` (receiver; `pull` / `warm` / `close`).
Both run on the service's event loop; `pull` awaits the network, never blocks the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import structlog
import torch

from shared.errors import DroidMeshError, IntegrityError, TransferError
from shared.transport.tensors import as_bytes, header_for, tensor_from
from shared.wire import schemas
from shared.wire.schemas import PullItem, PullRequest

# Listeners need tcp (sm alone cannot connect through a listener); must be set before import.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx  # noqa: E402

log = structlog.get_logger("ucx")

# (context_id, layer, kind) -> the stored tensor, or None when the sender does not hold it.
TensorLookup = Callable[[str, int, str], "torch.Tensor | None"]
# Called on the event loop as each tensor lands, in request order.
OnTensor = Callable[[PullItem, torch.Tensor], None]


class BulkServer:
    """Serves `PullRequest`s from a tensor lookup (the sender's store)."""

    def __init__(self, lookup: TensorLookup, authorize: Callable[[PullRequest], None] | None = None):
        self._lookup = lookup
        self._authorize = authorize
        self._listener: Any = None
        self._conns: set[asyncio.Task] = set()

    def start(self, port: int = 0) -> int:
        """Listen on `port` (0: an ephemeral one, announced to receivers); return the port."""
        self._listener = ucxx.create_listener(self._serve_endpoint, port=port)
        return self._listener.port

    async def _serve_endpoint(self, ep: Any) -> None:
        self._conns.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                try:
                    data = bytes(await ep.recv_obj())
                except Exception:  # peer closed or died: this endpoint's loop ends, others go on
                    return
                await self._serve_request(ep, data)
        finally:
            self._conns.discard(asyncio.current_task())  # type: ignore[arg-type]
            if not ep.closed:
                ep.abort()

    async def _serve_request(self, ep: Any, data: bytes) -> None:
        try:
            req = schemas.decode(data, PullRequest)
            if self._authorize is not None:
                self._authorize(req)
            tensors = []
            for item in req.items:
                t = self._lookup(req.context_id, item.layer, item.kind)
                if t is None:
                    raise TransferError(f"sender does not hold {req.context_id} layer {item.layer} {item.kind}")
                tensors.append(t)
        except DroidMeshError as e:
            log.warning("pull_refused", code=e.code, error=str(e))
            await ep.send_obj(schemas.encode(schemas.PullResponse(headers=[], error=f"{e.code}: {e}")))
            return
        headers = [header_for(req.context_id, it.layer, it.kind, t) for it, t in zip(req.items, tensors)]
        await ep.send_obj(schemas.encode(schemas.PullResponse(headers=headers)))
        # All sends posted together: the wire stays busy, and UCX keeps them in order.
        await asyncio.gather(*(ep.send(as_bytes(t)) for t in tensors))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


class BulkClient:
    """Pulls tensors from senders over cached endpoints (one per sender, one pull at a time)."""

    def __init__(self) -> None:
        self._eps: dict[tuple[str, int], Any] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def pull(
        self,
        host: str,
        port: int,
        request: PullRequest,
        expected: Callable[[PullItem], tuple[list[int], torch.dtype]],
        on_tensor: OnTensor,
        timeout_s: float,
    ) -> int:
        """Pull `request`'s items in order into freshly allocated buffers; return bytes pulled.

        Raises `TransferError` (peer gone, refused, deadline) or `IntegrityError` (header or
        checksum mismatch). On any error the endpoint is dropped, never reused half-read.
        """
        key = (host, port)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                async with asyncio.timeout(timeout_s):
                    ep = await self._endpoint(key)
                    return await self._pull_on(ep, request, expected, on_tensor)
            except (DroidMeshError, asyncio.CancelledError):
                await self._drop(key)  # a half-read endpoint is never reused
                raise
            except TimeoutError:
                await self._drop(key)
                raise TransferError(f"pull from {host}:{port} exceeded {timeout_s:.3g}s") from None
            except Exception as e:
                await self._drop(key)
                raise TransferError(f"pull from {host}:{port} failed: {type(e).__name__}: {e}") from e

    async def _pull_on(self, ep: Any, request: PullRequest, expected: Any, on_tensor: OnTensor) -> int:
        await ep.send_obj(schemas.encode(request))
        response = schemas.decode(bytes(await ep.recv_obj()), schemas.PullResponse)
        if response.error:
            raise TransferError(f"sender refused the pull: {response.error}")
        if len(response.headers) != len(request.items):
            raise IntegrityError(f"{len(response.headers)} headers for {len(request.items)} items")
        buffers = []
        for item, header in zip(request.items, response.headers):
            shape, dtype = expected(item)
            want = (request.context_id, item.layer, item.kind, list(shape), str(dtype).removeprefix("torch."))
            got = (header.context_id, header.layer, header.kind, header.shape, header.dtype)
            if got != want:
                raise IntegrityError(f"header {got} does not match the announced layout {want}")
            nbytes = torch.empty(shape, dtype=dtype, device="meta").numel() * dtype.itemsize
            if header.nbytes != nbytes:
                raise IntegrityError(f"layer {item.layer} {item.kind}: {header.nbytes} bytes for shape {shape}")
            buffers.append(torch.empty(nbytes, dtype=torch.uint8))  # our own buffer, sized by the layout
        receives = [asyncio.ensure_future(ep.recv(buf.numpy())) for buf in buffers]
        try:
            for item, header, buf, recv in zip(request.items, response.headers, buffers, receives):
                await recv  # in order: E first, so the engine can start while the rest streams
                on_tensor(item, tensor_from(buf, header))
        finally:
            for recv in receives:
                recv.cancel()
        return sum(h.nbytes for h in response.headers)

    async def _endpoint(self, key: tuple[str, int]) -> Any:
        ep = self._eps.get(key)
        if ep is None or ep.closed:
            ep = await ucxx.create_endpoint(*key)
            self._eps[key] = ep
        return ep

    async def _drop(self, key: tuple[str, int]) -> None:
        ep = self._eps.pop(key, None)
        if ep is not None and not ep.closed:
            ep.abort()

    async def warm(self, host: str, port: int) -> None:
        """Connect ahead of the first pull (a fresh endpoint's first transfer is ~3x slower)."""
        lock = self._locks.setdefault((host, port), asyncio.Lock())
        async with lock:
            await self._endpoint((host, port))

    async def close(self) -> None:
        for key in list(self._eps):
            await self._drop(key)
