"""The shm bulk channel: same-host pulls out of sealed shared memory, one kernel copy per byte.

Why a channel of its own: between two processes on one host, UCX reaches 0.18-0.25 of memcpy
here (CMA; README) and NIXL 0.08-0.46; the bytes need no network at all.

Sequence:
  0. `place` (`memfd.place`; the sender's torch thread, once per context it stores): the context
     moves into one sealed memfd, mapped read-only, so the store keeps the only copy and nothing
     changes it;
  1. per connection: the receiver dials the sender's Unix socket (the address is its path, in a
     directory only the sender's user may enter);
  2. per pull: `PullRequest` frame -> `ShmGrant` frame with its memfds attached (SCM_RIGHTS).
     The sender starts like every channel (`bulk.admit`: bounds, grant, lookups, hold); an item
     whose stored tensor lies in a placed memfd is granted where it lies (zero copy); any other
     (a CUDA store, a tensor never placed) is copied into one per-pull memfd, sealed the same way
     and charged to the pull budget. A refusal carries no memfd;
  3. the receiver checks the headers against its own buffers (`bulk.landings`), then every memfd
     (sealed against write and shrink: no byte changes and no page vanishes under a read, which
     would short it) and every region against its memfd's size, all before reading a byte; then
     `preadv` reads each layer's rows straight into its buffers on the client's copy lanes
     (threads; the GIL is released), every layer queued at once, in order; as a layer's reads
     finish, its items are delivered on the loop (one completion per layer);
  4. `ShmDone`: the sender releases the pull's hold. A dropped connection releases the same.

Capability: memfds travel only in a grant, to the connection that asked, and the receiver closes
them when the pull ends; a receiver that kept one could reread that context's sealed bytes,
which it was granted already. Nothing else of the sender's memory is reachable.
Integrity: headers carry no checksum here: the bytes are the sender's own sealed memory, copied
by the kernel, with no wire to corrupt them and no writer left to change them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import math
import os
import resource
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence

import msgspec
import structlog
import torch
from droidmesh.shared.errors import DroidMeshError, IntegrityError, TransferError
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.transport import memfd, shm_io
from droidmesh.shared.transport.bulk import (
    MAX_REQUEST_BYTES,
    Authorize,
    Landing,
    OnItem,
    Pin,
    PullHold,
    TensorLookup,
    admit,
    guarded_pull,
    landings,
    refusal,
    token_axis,
)
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, ShmDone, ShmGrant, ShmRegion, TensorHeader, Transport

log = structlog.get_logger("shm")

IDLE_S = 600.0  # sender: an idle connection's next PullRequest
HOLD_S = 120.0  # sender: the longest a grant is held, from its send to its ShmDone
CONNECT_S = 10.0  # receiver: dialling a sender's socket (a full backlog would wait forever)
MAX_CONNECTIONS = 256  # connections served at once per sender (more are closed on arrival)
MAX_FDS = 8  # memfds one grant may carry (a sender passes at most two: placed + per-pull)
LANES = 2  # client copy threads: one core's copy reaches about half of memcpy from a memfd here
PIECE = 4 << 20  # bytes one lane reads per task: a big layer spreads over the lanes


def _rows(shape: Sequence[int], kind: str, element_size: int) -> tuple[int, int]:
    """(rows, bytes per row) of an item of `shape`: one row per leading index before the token
    axis (a K / V head; E has one), each its tokens x the trailing dims."""
    axis = token_axis(kind)
    return math.prod(shape[:axis]), math.prod(shape[axis:]) * element_size


# -- server -------------------------------------------------------------------------------------
class ShmBulkServer:
    """Grants `PullRequest`s from a tensor lookup (the sender's store) as sealed memfds."""

    transport: Transport = "shm"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, pin: Pin | None = None,
                 max_connections: int = MAX_CONNECTIONS):
        self._lookup, self._authorize, self._pin, self._max = lookup, authorize, pin, max_connections
        self._dir = ""
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    place = staticmethod(memfd.place)

    async def start(self) -> str:
        """Listen on a Unix socket in a fresh directory of mode 0700; return its path."""
        _raise_fd_limit()  # each placed context holds two descriptors (its memfd, its mapping's)
        self._dir = tempfile.mkdtemp(prefix="droidmesh-shm-")
        path = os.path.join(self._dir, "bulk.sock")
        sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(128)
        sock.setblocking(False)
        self._accepting = asyncio.create_task(self._accept(sock))
        thp = memfd.shmem_thp()
        log.info("shm_server_started", path=path, shmem_thp=thp)
        if thp in ("never", "deny"):
            log.warning("shm_small_pages", shmem_thp=thp,
                        hint=f"placed contexts use 4 KiB pages; `echo advise > {memfd.THP_SETTING}` lets them use 2 MiB "
                             "pages, which makes pulls faster (README: same-host data plane)")
        return path

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except Exception as e:  # out of fds, say: this accept fails, the listener goes on
                log.warning("shm_accept_failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.1)
                continue
            if len(self._conns) >= self._max:
                log.warning("shm_connection_refused", reason=f"{self._max} connections already served")
                conn.close()
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                async with asyncio.timeout(IDLE_S):
                    data, _ = await shm_io.recv_frame(conn, MAX_REQUEST_BYTES, 0)
                grant, fds, release = await self._grant(data)
                try:
                    async with asyncio.timeout(HOLD_S):  # a receiver that stops reading holds nothing longer
                        await shm_io.send_frame(conn, schemas.encode(grant), fds)
                        if not grant.response.error:
                            schemas.decode((await shm_io.recv_frame(conn, MAX_REQUEST_BYTES, 0))[0], ShmDone)
                finally:
                    release()
        except (EOFError, ConnectionError):
            pass  # the receiver closed or dropped the connection: what it held is released above
        except Exception as e:  # a bad peer ends this connection, never the server
            log.warning("shm_connection_dropped", error=f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    async def _grant(self, data: bytes) -> tuple[ShmGrant, list[int], Callable[[], None]]:
        """The grant for one request, the memfds it passes and the release of what it holds."""
        try:
            request = schemas.decode(data, PullRequest)
            stored, views, hold = admit(request, self._lookup, self._authorize, self._pin)
        except DroidMeshError as e:
            return ShmGrant(response=refusal(e)), [], _nothing
        scratch: list[int] = []

        def release() -> None:  # keeps `stored` (so every placed memfd granted stays open) until the pull ends
            for fd in scratch:
                os.close(fd)
            hold.release()
            stored.clear()

        try:
            return (*await self._regions(request, stored, views, hold, scratch), release)
        except DroidMeshError as e:
            release()
            return ShmGrant(response=refusal(e)), [], _nothing
        except BaseException:
            release()
            raise

    async def _regions(self, request: PullRequest, stored: list[torch.Tensor], views: list[torch.Tensor],
                       hold: PullHold, scratch: list[int]) -> tuple[ShmGrant, list[int]]:
        """Each item where it lies in a placed memfd, or in the per-pull memfd (fd -1 until it exists)."""
        fds: list[int] = []
        regions: list[ShmRegion] = []
        copies: list[tuple[int, torch.Tensor]] = []  # (offset in the per-pull memfd, view)
        copy_bytes = 0
        for item, t, view in zip(request.items, stored, views, strict=True):
            found = memfd.placed(t)
            if found is not None:
                seg, offset = found
                if seg.fd not in fds:
                    fds.append(seg.fd)
                rows, _ = _rows(t.shape, item.kind, t.element_size())
                regions.append(ShmRegion(fd=fds.index(seg.fd), offset=offset,
                                         stride=t.numel() * t.element_size() // max(rows, 1)))
            else:  # copied contiguous: row r right after row r - 1
                _, row = _rows(view.shape, item.kind, view.element_size())
                regions.append(ShmRegion(fd=-1, offset=copy_bytes, stride=row))
                copies.append((copy_bytes, view))
                copy_bytes += -(-view.numel() * view.element_size() // memfd.ALIGN) * memfd.ALIGN
        if copies:
            hold.charge(copy_bytes)  # counted before the copy exists
            fd = await _off_loop(memfd.sealed_memfd, copy_bytes, copies)
            scratch.append(fd)
            fds.append(fd)
            regions = [msgspec.structs.replace(r, fd=len(fds) - 1) if r.fd < 0 else r for r in regions]
        headers = [TensorHeader(context_id=request.context_id, layer=item.layer, kind=item.kind, shape=list(v.shape),
                                dtype=dtype_name(v.dtype), codec="raw", codec_params={},
                                nbytes=v.numel() * v.element_size(), checksum="")
                   for item, v in zip(request.items, views, strict=True)]
        return ShmGrant(response=schemas.PullResponse(headers=headers), regions=regions, fds=len(fds)), fds

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def _nothing() -> None:
    """The release of a grant that holds nothing."""


async def _off_loop(make: Callable[..., int], *args: object) -> int:
    """A descriptor made on a worker thread; if the caller is cancelled first, it is closed once made."""
    future = asyncio.get_running_loop().run_in_executor(None, make, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else os.close(f.result()))
        raise


def _raise_fd_limit() -> None:
    """Lift this process's soft descriptor limit to its hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("shm_fd_limit_raised", soft=soft, now=hard)


# -- client -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Read:
    fd: int
    offset: int
    into: memoryview


def _reads(land: Landing, region: ShmRegion, fds: list[int], sizes: list[int]) -> list[_Read]:
    """The preadv calls that fill `land`'s receive buffer from `region`, checked against the
    memfd's sealed size first. Rows and their length come from our own buffer, never the peer."""
    if land.header.codec != "raw":
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: codec {land.header.codec} over shm (raw only)")
    rows, row = _rows(land.header.shape, land.item.kind, land.out.element_size())
    if rows * row != land.header.nbytes or land.recv.numel() != land.header.nbytes:
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: {land.header.nbytes} bytes for {rows} x {row}")
    if not 0 <= region.fd < len(fds) or region.offset < 0 or (rows > 1 and region.stride < row):
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: bad region {region}")
    if rows and row and region.offset + (rows - 1) * region.stride + row > sizes[region.fd]:
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: region {region} ends past its memfd "
                             f"({sizes[region.fd]} bytes)")
    dest = land.recv.numpy().data
    if rows * row == 0:
        return []
    if region.stride == row:  # rows back to back (a whole stored tensor, E, a per-pull copy): one read
        rows, row = 1, rows * row
    return [_Read(fds[region.fd], region.offset + r * region.stride, dest[r * row:(r + 1) * row]) for r in range(rows)]


def _pieces(reads: list[_Read]) -> list[list[_Read]]:
    """`reads` in lane tasks of about PIECE bytes (a long read split, short ones grouped)."""
    split = [_Read(r.fd, r.offset + o, r.into[o:o + PIECE]) for r in reads for o in range(0, len(r.into), PIECE)]
    tasks: list[list[_Read]] = [[]]
    size = 0  # bytes in tasks[-1]
    for r in split:
        if tasks[-1] and size + len(r.into) > PIECE:
            tasks.append([])
            size = 0
        tasks[-1].append(r)
        size += len(r.into)
    return [t for t in tasks if t]


def _read(task: list[_Read]) -> None:
    """On a lane: the reads of one task (preadv releases the GIL)."""
    for r in task:
        if os.preadv(r.fd, [r.into], r.offset) != len(r.into):
            raise IntegrityError(f"short read of a sealed memfd at {r.offset}")


def _close_when_done(fds: list[int], futures: list[concurrent.futures.Future]) -> list[concurrent.futures.Future]:
    """Cancel the lane tasks not started and close `fds` once the running ones finish (a lane
    never reads a closed, possibly reused, descriptor number); return the running ones."""
    running = [f for f in futures if not f.cancel() and not f.done()]
    if not running:
        for fd in fds:
            os.close(fd)
        return running
    left, lock = [len(running)], threading.Lock()

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            for fd in fds:
                os.close(fd)

    for f in running:
        f.add_done_callback(one_done)
    return running


class ShmBulkClient:
    """Pulls over cached connections (one per sender socket, one pull at a time each)."""

    transport: Transport = "shm"

    def __init__(self, lanes: int = LANES) -> None:
        self._lanes = concurrent.futures.ThreadPoolExecutor(lanes, thread_name_prefix="shm-lane")
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull `request`'s items into `into`; return the payload bytes received. Raises
        `TransferError` (peer gone, refused, deadline) or `IntegrityError` (a header, memfd or
        region that does not match); the connection is then dropped, never reused half-read."""
        async def pull() -> int:
            return await self._pull_on(await self._connection(address), request, into, on_item)

        return await guarded_pull(address, timeout_s, self._locks.setdefault(address, asyncio.Lock()), pull,
                                  lambda: self._drop(address))

    async def _pull_on(self, sock: socket.socket, request: PullRequest, into: Sequence[torch.Tensor],
                       on_item: OnItem) -> int:
        await shm_io.send_frame(sock, schemas.encode(request))
        data, fds = await shm_io.recv_frame(sock, schemas.MAX_MESSAGE_BYTES, MAX_FDS)
        futures: list[concurrent.futures.Future] = []
        ok = False
        try:
            grant = schemas.decode(data, ShmGrant)
            lands = landings(request, grant.response, into)
            if grant.fds != len(fds) or len(grant.regions) != len(lands):
                raise IntegrityError(f"grant of {len(grant.regions)} regions and {grant.fds} memfds; "
                                     f"{len(lands)} items and {len(fds)} memfds arrived")
            sizes = [memfd.sealed_size(fd) for fd in fds]
            runs = [list(run) for _, run in itertools.groupby(zip(lands, grant.regions, strict=True),
                                                              key=lambda lr: lr[0].item.layer)]
            tasks = [[_reads(land, region, fds, sizes) for land, region in run] for run in runs]
            queued = [[self._lanes.submit(_read, t) for t in _pieces([r for reads in run for r in reads])] for run in tasks]
            futures = [f for run in queued for f in run]
            for run, run_futures in zip(runs, queued, strict=True):
                for f in run_futures:
                    await asyncio.wrap_future(f)
                for land, _ in run:
                    on_item(land.item, land.land(verify=False))  # raw: in place, or from host staging
            ok = True
        finally:
            running = _close_when_done(fds, futures)
            if not ok and running:  # the caller's buffers are written no more once the pull has failed
                await asyncio.shield(asyncio.gather(*map(asyncio.wrap_future, running), return_exceptions=True))
        await shm_io.send_frame(sock, schemas.encode(ShmDone()))
        return sum(land.header.nbytes for land in lands)

    async def _connection(self, address: str) -> socket.socket:
        sock = self._conns.get(address)
        if sock is not None and shm_io.alive(sock):
            return sock
        await self._drop(address)  # the sender closed an idle connection: dial again
        if not address.startswith("/") or len(address.encode()) > 107:
            raise TransferError(f"bad shm address {address!r}; expected a Unix socket's absolute path")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(CONNECT_S):
                await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        self._conns[address] = sock
        return sock

    async def _drop(self, address: str) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    async def warm(self, address: str) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._connection(address)

    async def close(self) -> None:
        for address in list(self._conns):
            await self._drop(address)
        await asyncio.to_thread(self._lanes.shutdown, wait=True, cancel_futures=True)
