"""The shm channel's sender side (`ShmBulkServer`): grants pulls as sealed memfds over a Unix socket.

`place` (`memfd.place`; the sender's torch thread, once per context it stores) moves the context
into one sealed memfd, mapped read-only, so the store keeps the only copy and nothing changes it.
`start` listens on a Unix socket in a fresh directory only the sender's user may enter (mode 0700);
per connection (its own task on the sender's event loop), admitted to a slot before a byte is read
(`slots.py`; the peer capped is the connecting process, as the kernel names it: SO_PEERCRED):
  1. a `PullRequest` frame (bounded before it is read; the wait bounded by the slot: the setup
     deadline from the connect until a pull completes, then the idle timeout; an idle
     connection's slot may go to a newcomer meanwhile) -> a `ShmGrant` frame with
     its memfds attached (SCM_RIGHTS). The sender starts like every channel (`answer.admit`:
     bounds, grant, lookups, hold); an item whose stored tensor lies in a placed memfd is granted
     where it lies (zero copy); any other (a CUDA store, a tensor never placed) is copied into one
     per-pull memfd, sealed the same way and charged to the pull budget. The grant says which
     memfds are placed (a receiver may keep those mapped) and, by inode, which placed memfds of
     this connection's earlier grants have since been let go. A refusal carries no memfd;
  2. `ShmDone` (the whole grant within HOLD_S): the pull's hold is released and, after a grant,
     the connection is proven (`Slot.pulled`). A dropped connection
     releases the same. A receiver's frames carry no descriptors we keep (`shm_io` takes none),
     and a bad one ends that connection (logged), never the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable, Sequence

import msgspec
import structlog
import torch

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.transport import codecs, cuda_ipc, memfd, shm_io, workers
from droidmesh.shared.transport.answer import admit, refusal
from droidmesh.shared.transport.bulk import MAX_REQUEST_BYTES, Authorize, Pin, PullHold, TensorLookup, token_axis
from droidmesh.shared.transport.exports import Export, Exporter, Sent
from droidmesh.shared.transport.shm.layout import rows
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits, Slots
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import DeviceExport, ShmDone, ShmGrant, ShmRegion
from droidmesh.shared.wire.schemas import PullItem, PullRequest, TensorHeader, Transport

log = structlog.get_logger("shm")
HOLD_S = 120.0  # the longest a grant is held, from its send to its ShmDone
_DEVICE = {codecs.DEVICE_PARAM: "cuda"}  # a header's codec params: the payload is device memory
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class ShmBulkServer:
    """Grants `PullRequest`s from a tensor lookup (the sender's store) as sealed memfds."""

    transport: Transport = "shm"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, pin: Pin | None = None,
                 limits: SlotLimits | None = None, device: Exporter | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._device = device or cuda_ipc.CudaExporter()
        self.slots = Slots("shm", limits)
        self._dir = ""
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    def place(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A host context into one sealed memfd; a device one into one exported allocation."""
        return memfd.place(tensors) if not tensors or tensors[0].device.type == "cpu" else self._device.place(tensors)

    async def start(self) -> str:
        """Listen on a Unix socket in a fresh directory of mode 0700; return its path."""
        memfd.raise_fd_limit()
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
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        slot: Slot | None = None
        sent = _Named(Sent(self._device.registry.live), Sent(memfd.live))  # what this connection's grants named
        try:
            slot = self.slots.admit(_peer(conn))  # before a byte is read; None: refused (logged)
            while slot is not None:
                async with slot.waiting():
                    data, _ = await shm_io.recv_frame(conn, MAX_REQUEST_BYTES, 0)
                grant, fds, release = await self._grant(data, sent, slot)
                try:
                    async with asyncio.timeout(HOLD_S):  # a receiver that stops reading holds nothing longer
                        await shm_io.send_frame(conn, schemas.encode(grant), fds)
                        if not grant.response.error:
                            schemas.decode((await shm_io.recv_frame(conn, MAX_REQUEST_BYTES, 0))[0], ShmDone)
                            slot.pulled()
                finally:
                    release()
        except (EOFError, ConnectionError, SlotEnded):
            pass  # the receiver went, or its slot ended (counted and logged there): what it held is released above
        except Exception as e:  # a bad peer ends this connection, never the server
            log.warning("shm_connection_dropped", error=f"{type(e).__name__}: {e}")
        finally:
            if slot is not None:
                self.slots.release(slot)
            conn.close()

    async def _grant(self, data: bytes, sent: _Named, slot: Slot) -> tuple[ShmGrant, list[int], Callable[[], None]]:
        """The grant for one request, the memfds it passes and the release of what it holds;
        `SlotEnded` when the connection's grantee is at its cap with every connection pulling."""
        try:
            request = schemas.decode(data, PullRequest)
            stored, views, hold, grantee = admit(request, self._lookup, self._authorize, self._pin)
        except DroidMeshError as e:
            return ShmGrant(response=refusal(e)), [], _nothing
        try:
            slot.claim(grantee)
        except SlotEnded:
            hold.release()
            raise
        scratch: list[int] = []

        def release() -> None:  # keeps `stored` (so every placed memfd granted stays open) until the pull ends
            for fd in scratch:
                os.close(fd)
            hold.release()
            stored.clear()

        try:
            return (*await self._regions(request, stored, views, hold, scratch, sent), release)
        except DroidMeshError as e:
            release()
            return ShmGrant(response=refusal(e)), [], _nothing
        except BaseException:
            release()
            raise

    async def _regions(self, request: PullRequest, stored: list[torch.Tensor], views: list[torch.Tensor],
                       hold: PullHold, scratch: list[int], sent: _Named) -> tuple[ShmGrant, list[int]]:
        """Each item where it lies in a placed memfd or a device export, or in the per-pull memfd
        (fd -1 until it exists)."""
        fds: list[int] = []
        placed: list[int] = []  # of `fds`, the placed memfds (a receiver may keep them mapped)
        exports: list[Export] = []
        regions: list[ShmRegion] = []
        copies: list[tuple[int, torch.Tensor]] = []  # (offset in the per-pull memfd, view)
        copy_bytes = 0
        for item, t, view in zip(request.items, stored, views, strict=True):
            found = memfd.placed(t)
            on_device = self._device.exported(t) if request.device_exports else None  # else: copied below
            if found is not None:
                seg, offset = found
                if seg.fd not in fds:
                    placed.append(len(fds))
                    fds.append(seg.fd)
                    sent.memfds.name(seg.inode)
                start, stride = _where(t, item, offset)
                regions.append(ShmRegion(fd=fds.index(seg.fd), offset=start, stride=stride))
            elif on_device is not None:
                export, offset = on_device
                if export not in exports:
                    exports.append(export)
                    sent.exports.name(export.export_id)
                start, stride = _where(t, item, offset)
                regions.append(ShmRegion(fd=-1, export=exports.index(export), offset=start, stride=stride))
            else:  # copied contiguous: row r right after row r - 1
                _, row = rows(view.shape, item.kind, view.element_size())
                regions.append(ShmRegion(fd=-1, offset=copy_bytes, stride=row))
                copies.append((copy_bytes, view))
                copy_bytes += -(-view.numel() * view.element_size() // memfd.ALIGN) * memfd.ALIGN
        if copies:
            hold.charge(copy_bytes)  # counted before the copy exists
            fd = await _off_loop(memfd.sealed_memfd, copy_bytes, copies)
            scratch.append(fd)
            fds.append(fd)
            regions = [msgspec.structs.replace(r, fd=len(fds) - 1) if r.fd < 0 and r.export < 0 else r for r in regions]
        # a device export's item says its payload is device memory: the receiver lands it on its
        # buffer's device, never through host staging
        headers = [TensorHeader(context_id=request.context_id, layer=item.layer, kind=item.kind, shape=list(v.shape),
                                dtype=dtype_name(v.dtype), codec="raw",
                                codec_params=dict(_DEVICE) if region.export >= 0 else {}, nbytes=v.nbytes, checksum="")
                   for item, v, region in zip(request.items, views, regions, strict=True)]
        named = [DeviceExport(export_id=e.export_id, nbytes=e.nbytes, handle=e.handle) for e in exports]
        return ShmGrant(response=schemas.PullResponse(headers=headers), regions=regions, fds=len(fds),
                        incarnation=self._device.registry.incarnation, exports=named, released=sent.exports.released(),
                        placed=placed, released_memfds=sent.memfds.released()), fds

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


@dataclasses.dataclass(frozen=True)
class _Named:
    """What one connection's grants have named: device exports (by number), placed memfds (by inode)."""

    exports: Sent
    memfds: Sent


def _where(t: torch.Tensor, item: PullItem, offset: int) -> tuple[int, int]:
    """A stored tensor's rows at byte `offset` of its memory: (where the item's first row starts,
    the bytes between rows)."""
    shape = t.shape
    n, _ = rows(shape, item.kind, 1)
    stride = t.nbytes // max(n, 1)
    # a row is one head's [T, hd]: a later start skips its first tokens in every row
    skip = item.start * stride // shape[token_axis(item.kind)] if item.start else 0  # admitted: has the axis
    return offset + skip, stride


def _nothing() -> None:
    """The release of a grant that holds nothing."""


def _peer(conn: socket.socket) -> str:
    """The connecting process as the kernel names it (its pid: a Unix socket has no address, and
    only the sender's own user can reach this one, so the uid tells receivers apart nowhere)."""
    pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return f"pid {pid} uid {uid}"


async def _off_loop(make: Callable[..., int], *args: object) -> int:
    """A descriptor made on a copying thread (`workers.copiers`). Cancelled, it returns once the thread is done
    (`workers.run_settled`), closing what it made: the pull's hold, released after this, charges
    the copy while it is made, and the stored views it reads stay held until then."""
    return await workers.run_settled(workers.copiers(), make, *args, abandon=os.close)
