"""The shm channel's receiver side (`ShmBulkClient`): pulls out of a sender's sealed memfds.

Per connection: the receiver dials the sender's Unix socket (the address is its path; within
CONNECT_S: a full backlog would wait forever). Per pull: the `PullRequest` frame, then the
`ShmGrant` frame and its memfds (at most MAX_FDS; the kernel closes any beyond). Before a byte is
read the receiver checks the headers against its own buffers (`bulk.landings`), every memfd
(sealed against write and shrink: no byte changes and no page vanishes under a read, which would
short it) and every region against its memfd's sealed size; rows and their length come from the
receiver's own buffers, never the peer. Then each layer's rows are read straight into its buffers
on the client's copy lanes (threads; the GIL is released), every layer queued at once, in order:
with `preadv` the first time a connection is passed a placed memfd, by a copy out of a kept
mapping of it after (`kept.py`: a placed context pulled again moves at memory speed). As a
layer's reads finish, its items are delivered on the loop. A pull of at most INLINE_BYTES is read
on the loop itself (a few microseconds; a lane's hand-off costs more). `ShmDone` ends the pull.

A receiver closes the passed descriptors when the pull ends; a kept mapping lets it reread only a
context's sealed bytes it was granted already, and only when a later grant passes that memfd
again. Headers carry no checksum here: the bytes are the sender's own sealed memory, copied by the
kernel or out of a read-only mapping, with no wire to corrupt them and no writer to change them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import itertools
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv import streams
from droidmesh.shared.transport import cuda_ipc, memfd, shm_io
from droidmesh.shared.transport.address import check_unix_path
from droidmesh.shared.transport.bulk import Landing, OnItem, land_async, landings
from droidmesh.shared.transport.client import ChannelClient
from droidmesh.shared.transport.codecs import asks_device
from droidmesh.shared.transport.exports import Export, Mapping, Mappings, Opener, check_region
from droidmesh.shared.transport.seals import sealed_stat
from droidmesh.shared.transport.shm import kept
from droidmesh.shared.transport.shm.kept import Identity, KeptMemfds, identity_of
from droidmesh.shared.transport.shm.layout import MAX_FDS, rows
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import ShmDone, ShmGrant, ShmRegion
from droidmesh.shared.wire.schemas import PullRequest, Transport

CONNECT_S = 10.0
LANES = 2  # copy threads: one core's copy from a memfd reaches about half of memcpy
MAX_PIECE = 8 << 20  # bytes one lane reads per task at most: a big layer spreads over the lanes
MIN_PIECE = 1 << 20  # ... and at least (a task's hand-off costs tens of microseconds)
MAPPINGS_IDLE_S = 30.0  # a connection idle this long lets go of its kept memfds and device exports
INLINE_BYTES = 256 << 10  # a pull this small is read on the event loop: microseconds, less than a hand-off


class _Read(NamedTuple):
    """`nbytes` bytes from `offset` of memfd `fd` into our memory at `dest` (in `owner`, held here
    so it outlives the read): by `preadv`, or, with `source` (a kept mapping of that memfd, held
    here so it cannot be unmapped under the copy), by a copy out of it."""

    fd: int
    offset: int
    dest: int
    nbytes: int
    owner: torch.UntypedStorage  # the memory `dest` lies in (its storage: alive whatever is done to the tensor)
    source: torch.Tensor | None

    def part(self, start: int, nbytes: int) -> _Read:
        return self._replace(offset=self.offset + start, dest=self.dest + start, nbytes=nbytes)


def _reads(land: Landing, region: ShmRegion, fds: list[int], sizes: list[int],
           sources: list[torch.Tensor | None]) -> list[_Read]:
    """The reads that fill `land`'s receive buffer (host memory: `out` itself, or host staging for
    a CUDA `out`) from `region`, checked against the memfd's sealed size first (a kept mapping is
    that size). Rows and their length come from our own buffer, never the peer."""
    n, row = _rows(land)
    if not 0 <= region.fd < len(fds) or region.offset < 0 or (n > 1 and region.stride < row):
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: bad region {region}")
    if asks_device(land.header.codec_params):  # its landing would be device memory: never a host read's target
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: a memfd region says device memory")
    end = region.offset + (n - 1) * region.stride + row  # one past the last byte read
    if n and row and end > sizes[region.fd]:
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: region {region} ends past its memfd "
                             f"({sizes[region.fd]} bytes)")
    if n * row == 0:
        return []
    source = sources[region.fd]
    if source is not None and end > source.numel():
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: region {region} ends past its mapping")
    into = land.out if land.in_place else land.recv  # in place: `out`'s own bytes, no view needed
    if not into.is_cpu or into.nbytes < n * row:  # a host read writes host memory we own, by address
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: a memfd region for a buffer "
                             f"on {into.device} of {into.nbytes} bytes")
    whole = _Read(fds[region.fd], region.offset, into.data_ptr(), n * row, into.untyped_storage(), source)
    if region.stride == row:  # rows back to back (a whole stored tensor, E, a per-pull copy): one read
        return [whole]
    return [whole.part(r * row, row)._replace(offset=region.offset + r * region.stride) for r in range(n)]


def _device_reads(land: Landing, region: ShmRegion, exports: list[Export], mappings: Mappings) -> _DeviceRead:
    """The copy that fills `land`'s buffer from a device export, checked against the export's size
    first (the mapping opened here the first time a grant names it). Rows and their length come
    from our own buffer, never the peer."""
    n, row = _rows(land)
    if not 0 <= region.export < len(exports):
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: bad region {region}")
    if not asks_device(land.header.codec_params):  # it would land in host staging: device to host to device
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: a device export's item not said to be device memory")
    export = exports[region.export]
    check_region(export, region.offset, region.stride, n, row)
    return _DeviceRead(mappings.get(export), region.offset, region.stride, n, row, land.recv)


@dataclasses.dataclass(frozen=True)
class _DeviceRead:
    mapping: Mapping
    offset: int
    stride: int
    rows: int
    row: int
    into: torch.Tensor

    def run(self) -> None:
        cuda_ipc.read(self.mapping, self.offset, self.stride, self.rows, self.row, self.into)


def _read_device(reads: list[_DeviceRead]) -> None:
    """A layer's device copies, on its buffers' copy stream; returns when they are done (one wait
    per layer, on the loop: a layer's device-to-device copy takes microseconds)."""
    for device, same in itertools.groupby(reads, key=lambda r: r.into.device):
        with streams.landing(device):
            for r in same:
                r.run()


@dataclasses.dataclass
class _Plan:
    """A checked grant: its items by layer (runs of (landing, region)), each layer's host reads
    and device copies, the passed memfds' identities and which of them to keep mapped after."""

    runs: list[list[tuple[Landing, ShmRegion]]]
    tasks: list[list[_Read]]
    on_device: list[list[_DeviceRead]]
    identities: list[Identity]
    to_keep: list[int]
    nbytes: int


def _plan(grant: ShmGrant, request: PullRequest, into: Sequence[torch.Tensor], fds: list[int], conn: _Conn) -> _Plan:
    """Every count, memfd and region of `grant` checked (device exports mapped) before any byte is read."""
    lands = landings(request, grant.response, into)
    if grant.fds != len(fds) or len(grant.regions) != len(lands) or len(grant.exports) > len(lands):
        raise IntegrityError(f"grant of {len(grant.regions)} regions, {grant.fds} memfds and "
                             f"{len(grant.exports)} exports; {len(lands)} items and {len(fds)} memfds arrived")
    if not all(0 <= i < len(fds) for i in grant.placed):
        raise IntegrityError(f"grant names placed memfds {grant.placed[:8]} of {len(fds)}")
    exports = [Export(e.export_id, e.nbytes, e.handle) for e in grant.exports]
    conn.mappings.update(grant.incarnation, exports, grant.released)
    conn.kept.update(grant.incarnation, grant.released_memfds)
    checked = [sealed_stat(fd) for fd in fds]  # refused unless sealed against write and shrink
    sizes = [st.st_size for st, _ in checked]
    identities = [identity_of(st, seals) for st, seals in checked]
    sources = [conn.kept.get(identities[i]) if i in grant.placed else None for i in range(len(fds))]
    runs = [list(run) for _, run in itertools.groupby(zip(lands, grant.regions, strict=True),
                                                      key=lambda lr: lr[0].item.layer)]
    tasks = [[r for land, region in run if region.export < 0 for r in _reads(land, region, fds, sizes, sources)]
             for run in runs]  # every memfd region checked before any device export is opened
    on_device = [[_device_reads(land, region, exports, conn.mappings) for land, region in run if region.export >= 0]
                 for run in runs]
    to_keep = [i for i in sorted(set(grant.placed)) if sources[i] is None and identities[i].keepable]
    return _Plan(runs, tasks, on_device, identities, to_keep, sum(land.header.nbytes for land in lands))


def _rows(land: Landing) -> tuple[int, int]:
    """(rows, bytes per row) of a raw item, from the receiver's own buffer; checked against the header."""
    if land.header.codec != "raw":
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: codec {land.header.codec} over shm (raw only)")
    n, row = rows(land.header.shape, land.item.kind, land.out.element_size())
    if n * row != land.header.nbytes:  # raw: the header's shape is `out`'s (checked), and so its bytes
        raise IntegrityError(f"layer {land.item.layer} {land.item.kind}: {land.header.nbytes} bytes for {n} x {row}")
    return n, row


def _piece(nbytes: int, lanes: int) -> int:
    """A pull's task size: its bytes spread over every lane (one task each when it is small),
    within [MIN_PIECE, MAX_PIECE], in whole 4 KiB pages."""
    per_lane = -(-nbytes // lanes)
    return min(MAX_PIECE, max(MIN_PIECE, -(-per_lane // 4096) * 4096))


def _pieces(reads: list[_Read], piece: int) -> list[list[_Read]]:
    """`reads` in lane tasks of about `piece` bytes (a long read split, short ones grouped)."""
    split = [r.part(o, min(piece, r.nbytes - o)) for r in reads for o in range(0, r.nbytes, piece)]
    tasks: list[list[_Read]] = [[]]
    size = 0  # bytes in tasks[-1]
    for r in split:
        if tasks[-1] and size + r.nbytes > piece:
            tasks.append([])
            size = 0
        tasks[-1].append(r)
        size += r.nbytes
    return [t for t in tasks if t]


def _read(task: list[_Read]) -> None:
    """On a lane: the reads of one task (preadv and ctypes' memmove release the GIL)."""
    for r in task:
        if r.source is not None:  # checked: [offset, offset + nbytes) lies in the mapping, `dest` is ours
            ctypes.memmove(r.dest, r.source.data_ptr() + r.offset, r.nbytes)
        elif os.preadv(r.fd, [(ctypes.c_char * r.nbytes).from_address(r.dest)], r.offset) != r.nbytes:
            raise IntegrityError(f"short read of a sealed memfd at {r.offset}")


def _after_all(futures: list[concurrent.futures.Future], then: Callable[[], None]) -> None:
    """Call `then` once, on the thread that finishes the last of `futures` (at once if none)."""
    if not futures:
        then()
        return
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)


def _all_done(futures: list[concurrent.futures.Future]) -> asyncio.Future[None]:
    """A layer's lane tasks as one future of the loop: done when the last of them is, with the
    first one's error (one wake-up of the loop per layer, not per task: on a host with as many
    cores as lanes, each wake-up takes a core from a lane)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if done.done():
            return
        for f in futures:
            if f.cancelled():
                done.cancel()
                return
            if f.exception() is not None:
                done.set_exception(f.exception())  # type: ignore[arg-type]
                return
        done.set_result(None)

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it any more
            loop.call_soon_threadsafe(settle)

    _after_all(futures, wake)
    return done


def _close_when_done(fds: list[int], futures: list[concurrent.futures.Future]) -> list[concurrent.futures.Future]:
    """Cancel the lane tasks not started and close `fds` once the running ones finish (a lane
    never reads a closed, possibly reused, descriptor number); return the running ones."""
    running = [f for f in futures if not f.cancel() and not f.done()]

    def close() -> None:
        for fd in fds:
            os.close(fd)

    _after_all(running, close)
    return running


@dataclasses.dataclass
class _Conn:
    """A connection to one sender: its socket, the sender's device exports it has open and the
    sender's placed memfds it keeps mapped."""

    sock: socket.socket
    mappings: Mappings
    kept: KeptMemfds
    idle: asyncio.TimerHandle | None = None  # `let_go` when no pull came for a while

    def let_go(self) -> None:
        """Drop every mapping of the sender's memory this connection holds: a release reaches us
        only with a grant, so an idle connection must not pin what the sender has let go."""
        self.mappings.close()
        self.kept.close()


class ShmBulkClient(ChannelClient[_Conn]):
    """Pulls over cached connections (one per sender socket, one pull at a time each)."""

    transport: Transport = "shm"

    def __init__(self, lanes: int = LANES, opener: Opener | None = None, kept_bytes: int = kept.MAX_BYTES,
                 mappings_idle_s: float = MAPPINGS_IDLE_S) -> None:
        super().__init__()
        self._lanes = concurrent.futures.ThreadPoolExecutor(lanes, thread_name_prefix="shm-lane")
        self._lane_count = lanes
        # placed memfds kept mapped per connection, in bytes (0: read every pull with preadv), and
        # how long an idle connection keeps them and its device exports open
        self._kept_bytes, self._mappings_idle_s = kept_bytes, mappings_idle_s
        if kept_bytes:
            memfd.raise_fd_limit()  # each kept mapping holds a descriptor
        self._opener: Opener = opener or cuda_ipc.open_export
        # a receiver with CUDA opens a GPU sender's exports; one without gets their items copied
        self._device_exports = opener is not None or torch.cuda.is_available()

    async def _pull_on(self, conn: _Conn, request: PullRequest, into: Sequence[torch.Tensor],
                       on_item: OnItem) -> int:
        if self._device_exports and not request.device_exports:  # this receiver maps a sender's device memory
            request = msgspec.structs.replace(request, device_exports=True)
        if conn.idle is not None:
            conn.idle.cancel()
        await shm_io.send_frame(conn.sock, schemas.encode(request))
        data, fds = await shm_io.recv_frame(conn.sock, schemas.MAX_MESSAGE_BYTES, MAX_FDS)
        futures: list[concurrent.futures.Future] = []
        ok = False
        try:
            plan = _plan(schemas.decode(data, ShmGrant), request, into, fds, conn)
            if plan.nbytes <= INLINE_BYTES:  # a lane's hand-off would cost more
                for run, reads, device in zip(plan.runs, plan.tasks, plan.on_device, strict=True):
                    _read(reads)
                    _read_device(device)
                    for land, _ in run:
                        on_item(land.item, land.land(verify=False))
            else:
                piece = _piece(plan.nbytes, self._lane_count)
                queued: list[list[concurrent.futures.Future]] = []
                for reads in plan.tasks:  # each future recorded as it is made: a failed submit leaves none untracked
                    queued.append([])
                    for task in _pieces(reads, piece):
                        queued[-1].append(self._lanes.submit(_read, task))
                        futures.append(queued[-1][-1])
                for run, run_futures, device in zip(plan.runs, queued, plan.on_device, strict=True):
                    _read_device(device)
                    await _all_done(run_futures)
                    for land, _ in run:
                        on_item(land.item, await land_async(land, verify=False))  # raw: in place, or from host staging
            for i in plan.to_keep:  # read once with preadv; mapped for the pulls after
                conn.kept.keep(fds[i], plan.identities[i])
            ok = True
        finally:
            running = _close_when_done(fds, futures)
            if len(conn.kept) or len(conn.mappings):
                conn.idle = asyncio.get_running_loop().call_later(self._mappings_idle_s, conn.let_go)
            if not ok and running:  # the caller's buffers are written no more once the pull has failed
                await asyncio.shield(asyncio.gather(*map(asyncio.wrap_future, running), return_exceptions=True))
        await shm_io.send_frame(conn.sock, schemas.encode(ShmDone()))
        return plan.nbytes

    def _alive(self, conn: _Conn) -> bool:
        return shm_io.alive(conn.sock)

    async def _connect(self, address: str) -> _Conn:
        check_unix_path(address, "shm")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(CONNECT_S):
                await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return _Conn(sock, Mappings(self._opener), KeptMemfds(self._kept_bytes))

    async def _disconnect(self, address: str, conn: _Conn) -> None:
        conn.let_go()  # a sender we no longer talk to keeps none of its memory alive through us
        if conn.idle is not None:
            conn.idle.cancel()
        conn.sock.close()

    async def _shutdown(self) -> None:
        await asyncio.to_thread(self._lanes.shutdown, wait=True, cancel_futures=True)
