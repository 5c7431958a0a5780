"""Device exports' lifetime, through the shm channel: registered once when a context is placed,
mapped once by a receiver however many pulls read it, released with the context (and the
receiver's mapping closed), dropped when the sender is another incarnation, and hostile regions
refused before any mapping is opened or byte read.

CUDA IPC cannot run here, so the exporter and the opener are an in-process stand-in over host
memory (`HostExporter`): the registry, the grants, the mapping cache and the checks are the real
ones; `cuda_ipc.place` / `open_export` are the GPU check's to exercise.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import re
import socket
import tempfile
import weakref

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport import codecs, memfd, shm_io
from droidmesh.shared.transport.cuda_ipc import DeviceMapping
from droidmesh.shared.transport.exports import Export, ExportRegistry, Mappings, check_region
from droidmesh.shared.transport.shm import ShmBulkClient, ShmBulkServer
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import DeviceExport, ShmGrant, ShmRegion
from droidmesh.shared.wire.schemas import PullItem, PullRequest, PullResponse, TensorHeader

ITEMS = [PullItem(0, "K"), PullItem(0, "V")]


class _Owner:
    """Referenced by a placement's views: its death is the context's."""


class HostExporter:
    """`cuda_ipc`'s exporter over host memory: one slab per placed context, its handle its number."""

    def __init__(self) -> None:
        self.registry = ExportRegistry()
        self.slabs: dict[int, torch.Tensor] = {}

    def place(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [t.numel() * t.element_size() for t in tensors]
        slab = torch.empty(sum(sizes), dtype=torch.uint8)  # [bytes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        views = [slab[o:o + n].view(t.dtype).view(t.shape) for o, n, t in zip(offsets, sizes, tensors, strict=True)]
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        export = self.registry.add(slab.data_ptr(), slab.numel(), str(len(self.slabs) + 1).encode())
        self.slabs[export.export_id] = slab
        owner = _Owner()
        weakref.finalize(owner, self._release, slab.data_ptr(), export.export_id)
        for view in views:
            view._droidmesh_export = owner  # type: ignore[attr-defined]
        return views

    def _release(self, base: int, export_id: int) -> None:
        self.registry.release(base, export_id)
        self.slabs.pop(export_id, None)

    def exported(self, t: torch.Tensor) -> tuple[Export, int] | None:
        base = t.untyped_storage().data_ptr()
        export = self.registry.locate(base, t.data_ptr() - base, t.numel() * t.element_size())
        return None if export is None else (export, t.data_ptr() - base)


class Opener:
    """Opens a `HostExporter`'s handles, counting opens and closes."""

    def __init__(self, exporter: HostExporter) -> None:
        self.exporter, self.opened, self.closed = exporter, [], 0

    def __call__(self, export: Export) -> DeviceMapping:
        slab = self.exporter.slabs.get(int(export.handle))
        if slab is None:
            raise IntegrityError(f"export {export.export_id}: cannot open its handle")
        self.opened.append(export.export_id)
        opener = self

        class Counted(DeviceMapping):
            def close(self) -> None:
                opener.closed += 1
                super().close()

        return Counted(slab, slab.numel())


def _context(exporter: HostExporter, seed: int) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    views = exporter.place([torch.randn(1, 2, 33, 8, generator=g), torch.randn(1, 2, 33, 8, generator=g)])
    return dict(zip([(0, "K"), (0, "V")], views, strict=True))


def _session(body, exporter: HostExporter, store: dict[str, dict]):
    async def run():
        server = ShmBulkServer(lambda c, l, k: store.get(c, {}).get((l, k)), None, device=exporter)
        address = await server.start()
        client = ShmBulkClient(opener=opener, mappings_idle_s=3600.0)  # pinned: no idle drop however slow the host
        try:
            return await body(client, address)
        finally:
            await client.close()
            await server.close()

    opener = Opener(exporter)
    return asyncio.run(run()), opener


async def _pull(client, address, context: str, tokens: int = 0) -> list[torch.Tensor]:
    n = tokens or 33
    into = [torch.empty(1, 2, n, 8) for _ in ITEMS]
    await client.pull(address, PullRequest(context_id=context, items=ITEMS, tokens=tokens), into, lambda *a: None, 10)
    return into


def test_an_export_registered_once_serves_many_pulls_through_one_mapping():
    """Five pulls of one context (whole and prefixes) read the sender's bytes; the context was
    registered once and the receiver opened its export once."""
    exporter = HostExporter()
    store = {"a": _context(exporter, 0)}

    async def body(client, address):
        return [await _pull(client, address, "a", tokens) for tokens in (0, 7, 0, 20, 33)]

    pulls, opener = _session(body, exporter, store)
    for got, tokens in zip(pulls, (0, 7, 0, 20, 33), strict=True):
        want = [store["a"][(0, "K")], store["a"][(0, "V")]]
        assert all(torch.equal(g, w[:, :, :tokens or 33]) for g, w in zip(got, want, strict=True))  # bitwise: copied bytes
    assert len(exporter.registry) == 1 and opener.opened == [1]


def test_a_released_context_is_released_by_both_sides():
    """Evicted (its tensors gone), a context's export leaves the registry; the next grant on the
    connection says so and the receiver closes its mapping; a pull of it is refused by lookup."""
    exporter = HostExporter()
    store = {"a": _context(exporter, 0), "b": _context(exporter, 1)}

    async def body(client, address):
        await _pull(client, address, "a")
        del store["a"]
        for _ in range(1000):  # the sender lets go of a pull's tensors when its ShmDone arrives: a few loop turns
            gc.collect()
            if len(exporter.registry) == 1:
                break
            await asyncio.sleep(0)
        assert len(exporter.registry) == 1  # only b's
        await _pull(client, address, "b")  # its grant reports a's export released
        conn = client._conns[address]
        return len(conn.mappings), client._opener.closed

    (held, closed), opener = _session(body, exporter, store)
    assert opener.opened == [1, 2] and (held, closed) == (1, 1)


def test_an_idle_connection_closes_its_mappings():
    """A release reaches the receiver only with a grant: a connection that pulls no more closes its
    mappings after its idle time (here 0.05 s; waited for, at most 30 s), so a sender's device
    memory is not pinned by a receiver that went quiet; the next pull opens the export again."""
    exporter = HostExporter()
    store = {"a": _context(exporter, 0)}

    async def run():
        server = ShmBulkServer(lambda c, l, k: store.get(c, {}).get((l, k)), None, device=exporter)
        address = await server.start()
        client = ShmBulkClient(opener=opener, mappings_idle_s=0.05)
        try:
            await _pull(client, address, "a")
            conn = client._conns[address]
            deadline = asyncio.get_running_loop().time() + 30.0
            while len(conn.mappings) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            idle = len(conn.mappings)
            got = await _pull(client, address, "a")
            return idle, got
        finally:
            await client.close()
            await server.close()

    opener = Opener(exporter)
    idle, got = asyncio.run(run())
    assert idle == 0 and opener.opened == [1, 1] and opener.closed >= 1
    assert torch.equal(got[0], store["a"][(0, "K")])  # bitwise: copied bytes


def test_a_restarted_sender_s_mappings_are_dropped_not_reused():
    """A grant from another incarnation (a restarted sender numbering its exports from 1 again)
    closes every mapping of the old one; export 1 is opened anew, never read through the old."""
    old, new = Export(1, 64, b"old"), Export(1, 64, b"new")
    opened: list[bytes] = []
    closed: list[bytes] = []

    def opener(export: Export) -> DeviceMapping:
        opened.append(export.handle)
        mapping = DeviceMapping(torch.zeros(64, dtype=torch.uint8), 64)
        mapping.close = lambda: closed.append(export.handle)  # type: ignore[method-assign]
        return mapping

    maps = Mappings(opener)
    maps.update("first", [old], [])
    maps.get(old)
    maps.update("first", [old], [])
    maps.get(old)  # the same incarnation: the same mapping
    maps.update("second", [new], [])
    maps.get(new)
    assert opened == [b"old", b"new"] and closed == [b"old"] and len(maps) == 1


def test_a_dead_sender_s_mappings_close_with_its_connection():
    exporter = HostExporter()
    store = {"a": _context(exporter, 0)}

    async def body(client, address):
        await _pull(client, address, "a")
        await client._disconnect(address, client._conns.pop(address))
        return client._opener.closed

    closed, opener = _session(body, exporter, store)
    assert closed == 1


def _hostile(grant: ShmGrant, opener: Opener, exporter: HostExporter, fds: tuple[int, ...] = ()) -> str:
    """A pull answered by `grant` (passing `fds`) from a hand-made sender: the error, with nothing opened."""
    async def run():
        path = os.path.join(tempfile.mkdtemp(), "s.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)

        async def serve():
            conn, _ = await asyncio.get_running_loop().sock_accept(listener)
            conn.setblocking(False)
            await shm_io.recv_frame(conn, 1 << 20, 0)
            await shm_io.send_frame(conn, schemas.encode(grant), list(fds))
            await asyncio.sleep(1)
            conn.close()

        task = asyncio.create_task(serve())
        client = ShmBulkClient(opener=opener)
        try:
            with pytest.raises(IntegrityError) as e:
                await _pull(client, path, "a")
            return str(e.value)
        finally:
            task.cancel()
            await client.close()
            listener.close()

    return asyncio.run(run())


@pytest.mark.parametrize("offset,stride,nbytes,export,match", [
    (-64, 33 * 8 * 4, 4096, 0, "bad region"),  # before the allocation
    (0, 16, 4096, 0, "bad region"),  # rows overlapping: stride under a row
    (3000, 33 * 8 * 4, 4096, 0, "ends past"),  # past its end
    (0, 33 * 8 * 4, 4096, 3, "bad region"),  # an export the grant does not name
    (0, 33 * 8 * 4, 100, 0, "declares 100 bytes|ends past"),  # a size smaller than the rows: refused before open
])
def test_hostile_offsets_and_lengths_are_refused_before_any_mapping_or_read(offset, stride, nbytes, export, match):
    exporter = HostExporter()
    _context(exporter, 0)  # export 1 exists, 2 x 2112 bytes
    opener = Opener(exporter)
    grant = ShmGrant(response=PullResponse(headers=_headers(device=True)),
                     regions=[ShmRegion(fd=-1, offset=offset, stride=stride, export=export)] * 2, incarnation="x",
                     exports=[DeviceExport(export_id=1, nbytes=nbytes, handle=b"1")])
    err = _hostile(grant, opener, exporter)
    assert opener.opened == [] and re.search(match, err), err


def _headers(device: bool) -> list[TensorHeader]:
    """K and V of layer 0 of context "a" (1 x 2 x 33 x 8 float32), said to be device memory or not."""
    header = TensorHeader(context_id="a", layer=0, kind="K", shape=[1, 2, 33, 8], dtype="float32", codec="raw",
                          codec_params={codecs.DEVICE_PARAM: "cuda"} if device else {}, nbytes=2 * 33 * 8 * 4,
                          checksum="")
    return [header, msgspec.structs.replace(header, kind="V")]


def test_a_device_exports_items_are_said_to_be_device_memory_and_a_memfds_are_not():
    """A grant says which items are device memory, so that a receiver with CUDA lands those on its
    buffers' device (in place, or in device staging) and never stages them through host memory:
    one item in a device export, one in a placed memfd, in one grant, each said as it is; pulled
    through the receiver, both arrive intact."""
    exporter = HostExporter()
    on_host = memfd.place([torch.randn(1, 2, 33, 8, generator=torch.Generator().manual_seed(3))])
    store = {"a": {(0, "K"): _context(exporter, 0)[(0, "K")], (0, "V"): on_host[0]}}

    async def body(client, address):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
        try:
            await shm_io.send_frame(sock, schemas.encode(PullRequest(context_id="a", items=ITEMS, device_exports=True)))
            data, fds = await shm_io.recv_frame(sock, schemas.MAX_MESSAGE_BYTES, 8)
            for fd in fds:
                os.close(fd)
        finally:
            sock.close()
        return schemas.decode(data, ShmGrant), await _pull(client, address, "a")

    (grant, got), _ = _session(body, exporter, store)
    assert [codecs.asks_device(h.codec_params) for h in grant.response.headers] == [True, False]
    assert [r.export >= 0 for r in grant.regions] == [True, False]
    assert torch.equal(got[0], store["a"][(0, "K")]) and torch.equal(got[1], on_host[0])  # bitwise: copied bytes


def test_an_item_said_to_be_where_it_is_not_is_refused_before_any_mapping_or_read():
    """A device export's item not said to be device memory (it would be staged through host
    memory: device to host to device) and a memfd's item said to be device memory (a host read
    into a device buffer): both refused before any export is opened or byte read."""
    exporter = HostExporter()
    _context(exporter, 0)
    opener = Opener(exporter)
    row = 33 * 8 * 4
    staged = ShmGrant(response=PullResponse(headers=_headers(device=False)),
                      regions=[ShmRegion(fd=-1, offset=0, stride=row, export=0)] * 2, incarnation="x",
                      exports=[DeviceExport(export_id=1, nbytes=4 * 2 * row, handle=b"1")])
    assert "not said to be device memory" in _hostile(staged, opener, exporter)
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4 * 2 * row)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS)
        on_host = ShmGrant(response=PullResponse(headers=_headers(device=True)),
                           regions=[ShmRegion(fd=0, offset=0, stride=row), ShmRegion(fd=0, offset=2 * row, stride=row)],
                           fds=1)
        assert "a memfd region says device memory" in _hostile(on_host, opener, exporter, (fd,))
    finally:
        os.close(fd)
    assert opener.opened == []


def test_region_checks_on_their_own():
    e = Export(1, 1000, b"")
    check_region(e, 0, 100, 10, 100)  # exactly fills it
    for args in [(-1, 100, 2, 10), (0, 5, 2, 10), (901, 100, 1, 100), (0, 100, 11, 100)]:
        with pytest.raises(IntegrityError):
            check_region(e, *args)


def test_a_receiver_that_cannot_map_device_memory_gets_the_items_copied():
    """A receiver without CUDA (no opener of its own) does not ask for device exports: the sender
    copies those items into a per-pull memfd, as it does for anything it did not place."""
    exporter = HostExporter()
    store = {"a": _context(exporter, 0)}

    async def run():
        server = ShmBulkServer(lambda c, l, k: store.get(c, {}).get((l, k)), None, device=exporter)
        address = await server.start()
        client = ShmBulkClient()  # the CPU's: no CUDA here
        try:
            got = await _pull(client, address, "a", 7)
            return got, len(client._conns[address].mappings)
        finally:
            await client.close()
            await server.close()

    got, mapped = asyncio.run(run())
    assert mapped == 0
    assert all(torch.equal(g, store["a"][(0, k)][:, :, :7]) for g, k in zip(got, "KV", strict=True))  # bitwise: copied bytes
