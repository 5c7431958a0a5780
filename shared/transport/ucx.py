"""The UCX bulk channel (ucxx): one `BulkServer` / `BulkClient` pair over real endpoints.

The protocol and its checks are `shared/transport/bulk.py`'s; this module only moves bytes:
the request and response as UCX object messages, then every payload as one tagged message,
all posted at once in order (UCX matches same-tag messages in order), so the wire stays busy and
there is no per-item round trip. The client keeps one endpoint per sender address and runs one
pull at a time on it; any error drops the endpoint, which is never reused half-read.

ucxx is imported on first use, and UCX is configured through `ucxx.init` options, never by
changing the process environment: listeners need tcp (sm alone cannot connect through a
listener). `UCX_*` variables set by an operator still win.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from shared.errors import DroidMeshError, TransferError
from shared.transport.bulk import Authorize, OnItem, TensorLookup, answer, landings
from shared.wire import schemas
from shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("ucx")
# Listener endpoints always run with peer-failure error handling (ucxx cannot accept a connection
# without it), and under it UCX only takes a transport for zero-copy rendezvous if its memory
# domain can invalidate memory (ucp_wireup.c; "for data integrity in case of error"). CMA's
# domain never claims that, so same-host bulk went through TCP on loopback (and posix/sysv are
# dropped too unless MM_ERROR_HANDLING=y). CMA_MEMORY_INVALIDATE=y only declares the capability,
# which makes rendezvous "zero-copy read from remote" over CMA eligible: the receiver's own thread
# copies the sender's payload into its buffer with process_vm_readv (one copy, no bounce buffer).
# What the missing invalidation could cost after a peer failure is a read of a sender buffer the
# sender already reused; those bytes fail the payload checksum. Measured here between two
# processes: 16-256 MiB 1.1-1.5 GB/s against 0.55-0.62 over tcp/lo (README, bench transfer).
# MM_ERROR_HANDLING=y (sysv fragments for the bulk) is left off: it swung from 0.2 to 3.5 GB/s
# run to run on two busy cores, as each 512 KiB fragment needs both processes scheduled at once.
UCX_OPTIONS = {"TLS": "tcp,sm,self", "CMA_MEMORY_INVALIDATE": "y", "WARN_UNUSED_ENV_VARS": "n"}
_ucxx: Any = None


def ucxx() -> Any:
    """The ucxx module, initialised once with DroidMesh's UCX options."""
    global _ucxx
    if _ucxx is None:
        import ucxx as module

        module.init(options=UCX_OPTIONS, env_takes_precedence=True)
        _ucxx = module
    return _ucxx


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port); `TransferError` for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad ucx address {address!r}; expected host:port")
    return host, int(port)


class UcxBulkServer:
    """Serves `PullRequest`s from a tensor lookup (the sender's store) on a UCX listener."""

    transport: Transport = "ucx"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0):
        self._lookup, self._authorize = lookup, authorize
        self._host, self._port = host, port
        self._listener: Any = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> str:
        """Listen on the configured port (0: an ephemeral one); return "host:port"."""
        self._listener = ucxx().create_listener(self._serve_endpoint, port=self._port)
        return f"{self._host}:{self._listener.port}"

    async def _serve_endpoint(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None  # a listener callback always runs as a task
        self._conns.add(task)
        try:
            while True:
                try:
                    data = bytes(await ep.recv_obj())
                except Exception:  # peer closed or died: this endpoint's loop ends, others go on
                    return
                await self._serve_request(ep, data)
        finally:
            self._conns.discard(task)
            if not ep.closed:
                ep.abort()

    async def _serve_request(self, ep: Any, data: bytes) -> None:
        try:
            request = schemas.decode(data, PullRequest)
        except DroidMeshError as e:
            await ep.send_obj(schemas.encode(schemas.PullResponse(headers=[], error=f"{e.code}: {e}")))
            return
        response, payloads = answer(request, self._lookup, self._authorize)
        await ep.send_obj(schemas.encode(response))
        await asyncio.gather(*(ep.send(p.numpy()) for p in payloads))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


class UcxBulkClient:
    """Pulls over cached endpoints (one per sender address, one pull at a time each)."""

    transport: Transport = "ucx"

    def __init__(self) -> None:
        self._eps: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull `request`'s items into `into`; return the payload bytes received.

        Raises `TransferError` (peer gone, refused, deadline) or `IntegrityError` (header or
        checksum mismatch). On any error the endpoint is dropped, never reused half-read."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            try:
                async with asyncio.timeout(timeout_s):
                    ep = await self._endpoint(address)
                    return await self._pull_on(ep, request, into, on_item)
            except (DroidMeshError, asyncio.CancelledError):
                await self._drop(address)
                raise
            except TimeoutError:
                await self._drop(address)
                raise TransferError(f"pull from {address} exceeded {timeout_s:.3g}s") from None
            except Exception as e:
                await self._drop(address)
                raise TransferError(f"pull from {address} failed: {type(e).__name__}: {e}") from e

    async def _pull_on(self, ep: Any, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem) -> int:
        await ep.send_obj(schemas.encode(request))
        response = schemas.decode(bytes(await ep.recv_obj()), schemas.PullResponse)
        lands = landings(request, response, into)
        receives = [asyncio.ensure_future(ep.recv(land.recv.numpy())) for land in lands]
        try:
            for land, recv in zip(lands, receives, strict=True):
                await recv  # in order: E first, so the engine can start while the rest streams
                on_item(land.item, land.land())
        finally:
            for recv in receives:
                recv.cancel()
        return sum(land.header.nbytes for land in lands)

    async def _endpoint(self, address: str) -> Any:
        ep = self._eps.get(address)
        if ep is None or ep.closed:
            ep = await ucxx().create_endpoint(*parse_address(address))
            self._eps[address] = ep
        return ep

    async def _drop(self, address: str) -> None:
        ep = self._eps.pop(address, None)
        if ep is not None and not ep.closed:
            ep.abort()

    async def warm(self, address: str) -> None:
        """Connect ahead of the first pull (a fresh endpoint's first transfer is ~3x slower)."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._endpoint(address)

    async def close(self) -> None:
        for address in list(self._eps):
            await self._drop(address)
