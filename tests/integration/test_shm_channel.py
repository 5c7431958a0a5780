"""The shm channel's own guarantees beyond the shared contract: placed tensors travel without a
copy on the sender, anything else through a charged per-pull memfd; a hostile sender's memfds and
regions are refused before a byte is read; no descriptor outlives its pull."""

from __future__ import annotations

import asyncio
import collections
import fcntl
import gc
import os
import socket
import tempfile

import msgspec
import pytest
import torch

from droidmesh.shared.errors import BadMessageError, IntegrityError
from droidmesh.shared.transport import memfd, shm, shm_io
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import ShmGrant, ShmRegion
from droidmesh.shared.wire.schemas import PullItem, PullRequest, PullResponse, TensorHeader

ITEMS = [PullItem(0, "K"), PullItem(0, "V")]
PINNED_S = 3600.0  # an idle time no test reaches: the idle drop is pinned off where a test counts mappings
GUARD_S = 30.0  # a wait for an event that never comes fails the test (a hang guard, not a timing assertion)


def _open_fds() -> int:
    gc.collect()  # what earlier tests dropped
    return len(os.listdir("/proc/self/fd"))


class Hold:
    """A store's hold that records what a pull charges."""

    def __init__(self) -> None:
        self.charged, self.released = 0, False

    def charge(self, nbytes: int) -> None:
        self.charged += nbytes

    def refund(self, nbytes: int) -> None:
        self.charged -= nbytes

    def release(self) -> None:
        self.released = True


def _pull(lookup, items, into, tokens=0, client=None):
    holds: list[Hold] = []

    def pin(_: str) -> Hold:
        holds.append(Hold())
        return holds[-1]

    async def run():
        server = make_server("shm", lookup, None, pin=pin)
        address = await server.start()
        c = client or make_client("shm")
        try:
            return await c.pull(address, PullRequest(context_id="ctx", items=items, tokens=tokens), into,
                                lambda *a: None, 10)
        finally:
            await c.close()
            await server.close()

    return asyncio.run(run()), holds


def test_placed_tensors_are_granted_where_they_lie_without_a_copy():
    """A placed context's K / V (whole or a prefix) reach the receiver intact and the pull charges nothing."""
    placed = memfd.place([torch.randn(1, 2, 33, 8), torch.randn(1, 2, 33, 8)])
    lookup = dict(zip([(0, "K"), (0, "V")], placed, strict=True))
    for tokens in (0, 7):
        n = tokens or 33
        into = [torch.empty(1, 2, n, 8) for _ in ITEMS]
        nbytes, holds = _pull(lambda c, l, k: lookup.get((l, k)), ITEMS, into, tokens)
        assert nbytes == 2 * 2 * n * 8 * 4
        assert all(torch.equal(got, t[:, :, :n]) for got, t in zip(into, placed, strict=True))  # bitwise: the memfd holds the placed bytes
        assert holds[0].charged == 0 and holds[0].released


def test_tensors_not_placed_go_through_a_charged_per_pull_memfd():
    """A tensor outside any placed memfd is copied for the pull, charged first, and the hold released after."""
    plain = {(0, k): torch.randn(1, 2, 33, 8) for k in "KV"}
    into = [torch.empty(1, 2, 33, 8) for _ in ITEMS]
    _, holds = _pull(lambda c, l, k: plain.get((l, k)), ITEMS, into)
    assert all(torch.equal(got, plain[(0, k)]) for got, k in zip(into, "KV", strict=True))  # bitwise: the memfd copies the bytes
    assert holds[0].charged >= 2 * 2 * 33 * 8 * 4 and holds[0].released


def test_a_mixed_grant_delivers_every_layer_in_order_with_prefixes():
    """Placed and unplaced items of several layers in one pull, cut to a prefix: each lands intact,
    in request order, one layer's items together; placed ones cost no copy."""
    placed = memfd.place([torch.randn(1, 2, 33, 8), torch.randn(1, 2, 33, 8), torch.randn(1, 33, 16)])
    stored = {(0, "K"): placed[0], (0, "V"): placed[1], (1, "E"): placed[2],
              (1, "K"): torch.randn(1, 2, 33, 8), (1, "V"): torch.randn(1, 2, 33, 8)}
    items = [PullItem(1, "E"), PullItem(0, "K"), PullItem(0, "V"), PullItem(1, "K"), PullItem(1, "V")]
    into = [torch.empty((1, 9, 16) if it.kind == "E" else (1, 2, 9, 8)) for it in items]
    order: list[PullItem] = []

    async def run():
        server = make_server("shm", lambda c, l, k: stored.get((l, k)), None, pin=lambda _: hold)
        address = await server.start()
        client = make_client("shm")
        try:
            return await client.pull(address, PullRequest(context_id="ctx", items=items, tokens=9), into,
                                     lambda it, t: order.append(it), 10)
        finally:
            await client.close()
            await server.close()

    hold = Hold()
    asyncio.run(run())
    assert order == items
    for it, got in zip(items, into, strict=True):
        want = stored[(it.layer, it.kind)]
        assert torch.equal(got, want[:, :9] if it.kind == "E" else want[:, :, :9])  # bitwise: the channel copies the stored bytes
    assert 0 < hold.charged <= 2 * 2 * 9 * 8 * 4 + 2 * memfd.ALIGN and hold.released  # the two unplaced K / V only


# -- kept mappings: a placed memfd mapped once, read by offset, let go when its context goes -----
def _mappings() -> collections.Counter[int]:
    """This process's mappings of KV memfds, counted by inode (/proc/self/maps: inode is field 5)."""
    with open("/proc/self/maps") as f:
        return collections.Counter(int(line.split()[4]) for line in f if "/memfd:droidmesh-kv" in line)


def _pulls(stored: dict, requests: list[tuple[str, int]], between=None):
    """Pull (context, tokens) after (context, tokens) over one connection, each into fresh
    buffers; `between(i)` runs before pull i. The buffers, the preadv calls each pull made and
    what the connection kept mapped after each pull."""
    got, preads, kept = [], [], []
    calls = [0]
    real = os.preadv

    def counting(*args):
        calls[0] += 1
        return real(*args)

    async def run():
        server = make_server("shm", lambda c, l, k: stored.get((c, l, k)), None, pin=lambda _: Hold())
        address = await server.start()
        client = shm.ShmBulkClient(mappings_idle_s=PINNED_S)  # no idle drop between these pulls, however slow
        try:
            for i, (context, tokens) in enumerate(requests):
                if between is not None:
                    between(i)
                into = [torch.empty(1, 2, tokens, 8) for _ in ITEMS]
                calls[0] = 0
                await client.pull(address, PullRequest(context_id=context, items=ITEMS, tokens=tokens), into,
                                  lambda *a: None, 10)
                got.append(into)
                preads.append(calls[0])
                conn = client._conns[address]
                kept.append((conn.kept.mapped, conn.kept.inodes(), _mappings()))
        finally:
            await client.close()
            await server.close()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "preadv", counting)
        asyncio.run(run())
    return got, preads, kept


def _placed_context(name: str, stored: dict, tokens: int = 600) -> list[torch.Tensor]:
    placed = memfd.place([torch.randn(1, 2, tokens, 8), torch.randn(1, 2, tokens, 8)])  # 2 x 38 KiB
    stored.update({(name, 0, "K"): placed[0], (name, 0, "V"): placed[1]})
    return placed


def test_a_placed_context_is_mapped_once_and_read_by_offset_from_then_on():
    """The first pull reads the placed memfd with preadv and maps it; every later pull of that
    context (whole or a prefix) copies out of the one mapping, no preadv, and lands intact."""
    stored: dict = {}
    placed = _placed_context("a", stored)
    got, preads, kept = _pulls(stored, [("a", 600), ("a", 600), ("a", 100), ("a", 600)])
    for into, n in zip(got, (600, 600, 100, 600), strict=True):
        assert all(torch.equal(g, t[:, :, :n]) for g, t in zip(into, placed, strict=True))  # bitwise: copied bytes
    assert preads[0] > 0 and preads[1:] == [0, 0, 0]
    assert [k[0] for k in kept] == [1, 1, 1, 1]  # one mapping, whatever the pulls


def test_a_buffer_outside_host_memory_is_refused_before_a_host_read_writes_it():
    """The shm client writes a memfd's bytes by address: into anything but our own host memory
    (here a `meta` buffer, whose address is 0) that would be a wild write, so it is refused, on a
    connection whose mapping of the context is kept as on one that reads with preadv."""
    stored: dict = {}
    _placed_context("a", stored)

    async def run() -> list[str]:
        server = make_server("shm", lambda c, l, k: stored.get((c, l, k)), None, pin=lambda _: Hold())
        address = await server.start()
        client = shm.ShmBulkClient(mappings_idle_s=PINNED_S)
        errors = []
        try:
            for device in ("cpu", "meta", "meta"):  # the first pull maps the context
                into = [torch.empty(1, 2, 600, 8, device=device) for _ in ITEMS]
                try:
                    await client.pull(address, PullRequest(context_id="a", items=ITEMS), into, lambda *a: None, 10)
                except IntegrityError as e:
                    errors.append(str(e))
        finally:
            await client.close()
            await server.close()
        return errors

    errors = asyncio.run(run())
    assert len(errors) == 2 and all("a buffer on meta" in e for e in errors), errors


def test_a_released_context_is_unmapped_at_the_connections_next_grant():
    """When the sender lets a context go, its next grant on the connection names the memfd and the
    receiver unmaps it (the sender's memory returns); a context still held stays mapped."""
    stored: dict = {}
    _placed_context("a", stored)
    b = _placed_context("b", stored)
    inode_a = memfd.placed(stored[("a", 0, "K")])[0].inode  # type: ignore[index]

    def drop_a(i: int) -> None:
        if i == 2:  # the sender evicts "a": its placed tensors die, the memfd is let go
            for key in [k for k in stored if k[0] == "a"]:
                del stored[key]
            gc.collect()

    got, _, kept = _pulls(stored, [("a", 600), ("b", 600), ("b", 600)], between=drop_a)
    assert inode_a in kept[1][1]  # kept while the sender held it
    assert inode_a not in kept[2][1] and len(kept[2][1]) == 1  # released at the next grant; "b" stays
    assert all(torch.equal(g, t) for g, t in zip(got[2], b, strict=True))  # bitwise: copied bytes
    assert inode_a not in _mappings()


def test_the_connections_mappings_go_with_it():
    """Closing the client unmaps every memfd it kept: only the sender's own mapping of its placed
    context is left (here, one process plays both)."""
    stored: dict = {}
    _placed_context("a", stored)
    inode = memfd.placed(stored[("a", 0, "K")])[0].inode  # type: ignore[index]
    gc.collect()
    senders = _mappings()[inode]
    _, _, kept = _pulls(stored, [("a", 600), ("a", 600)])
    assert kept[-1][1] == {inode} and kept[-1][2][inode] > senders  # the receiver's mapping beside the sender's
    gc.collect()
    assert _mappings()[inode] == senders


def test_an_idle_connection_lets_its_mappings_go():
    """A release reaches the receiver only with a grant: a connection that pulls no more drops its
    mappings after its idle time (here 0.05 s; the test waits for the drop, at most GUARD_S)."""
    stored: dict = {}
    placed = _placed_context("a", stored)

    async def run() -> tuple[int, int]:
        server = make_server("shm", lambda c, l, k: stored.get((c, l, k)), None, pin=lambda _: Hold())
        address = await server.start()
        client = shm.ShmBulkClient(mappings_idle_s=0.05)
        try:
            for _ in range(2):
                into = [torch.empty(1, 2, 600, 8) for _ in ITEMS]
                await client.pull(address, PullRequest(context_id="a", items=ITEMS, tokens=600), into,
                                  lambda *a: None, 10)
            conn = client._conns[address]
            mapped = conn.kept.mapped  # not len(conn.kept): on a busy host the timer may already have fired
            deadline = asyncio.get_running_loop().time() + GUARD_S
            while len(conn.kept) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            return mapped, len(conn.kept)
        finally:
            await client.close()
            await server.close()

    mapped, left = asyncio.run(run())
    assert mapped >= 1 and left == 0  # kept once at least (again, if the timer fired between the pulls), then dropped
    assert placed  # the sender still holds the context: the drop was the receiver's own


# -- a hostile sender ---------------------------------------------------------------------------
def _memfd(nbytes: int, seals: int = memfd.SEALS) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _header(n: int = 33, codec: str = "raw") -> TensorHeader:
    return TensorHeader(context_id="ctx", layer=0, kind="K", shape=[1, 2, n, 8], dtype="float32", codec=codec,
                        codec_params={}, nbytes=2 * n * 8 * 4, checksum="")


NBYTES = 2 * 33 * 8 * 4


def _forged(case: str) -> tuple[ShmGrant, list[int]]:
    """A grant for one K item, forged as `case` says, and the descriptors it passes."""
    good = ShmGrant(response=PullResponse(headers=[_header()]), regions=[ShmRegion(fd=0, offset=0, stride=33 * 32)], fds=1)
    if case == "unsealed":
        return good, [_memfd(NBYTES, seals=0)]
    if case == "shrinkable":
        return good, [_memfd(NBYTES, seals=fcntl.F_SEAL_WRITE)]
    if case == "past-the-end":
        return msgspec.structs.replace(good, regions=[ShmRegion(fd=0, offset=64, stride=33 * 32)]), [_memfd(NBYTES)]
    if case == "overlapping-rows":
        return msgspec.structs.replace(good, regions=[ShmRegion(fd=0, offset=0, stride=8)]), [_memfd(NBYTES)]
    if case == "fd-out-of-range":
        return msgspec.structs.replace(good, regions=[ShmRegion(fd=3, offset=0, stride=33 * 32)]), [_memfd(NBYTES)]
    if case == "not-shared-memory":
        f = tempfile.TemporaryFile()
        f.truncate(NBYTES)
        return good, [os.dup(f.fileno())]
    if case == "a-pipe":
        r, w = os.pipe()
        os.close(w)
        return good, [r]
    if case == "fewer-fds-than-declared":
        return msgspec.structs.replace(good, fds=2), [_memfd(NBYTES)]
    if case == "too-many-fds":
        return good, [_memfd(NBYTES) for _ in range(shm.MAX_FDS + 1)]
    if case == "placed-out-of-range":
        return msgspec.structs.replace(good, placed=[1]), [_memfd(NBYTES)]
    if case == "encoded":
        header = msgspec.structs.replace(_header(codec="int8"), nbytes=400)  # within int8's bound: shm's own check
        return msgspec.structs.replace(good, response=PullResponse(headers=[header])), [_memfd(NBYTES)]
    raise AssertionError(case)


async def _hostile_sender(case: str, path: str, ready: asyncio.Event) -> None:
    """Answer one pull with a forged grant, then wait for the receiver to hang up."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    ready.set()
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    try:
        await shm_io.recv_frame(conn, 1 << 16, 0)
        grant, fds = _forged(case)
        try:
            await shm_io.send_frame(conn, schemas.encode(grant), fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            await shm_io.recv_frame(conn, 1 << 16, 0)
        except (EOFError, ConnectionError):
            pass
    finally:
        conn.close()
        listener.close()


CASES = {"unsealed": "not sealed against write and shrink", "shrinkable": "not sealed against write and shrink",
         "past-the-end": "ends past its memfd", "overlapping-rows": "bad region", "fd-out-of-range": "bad region",
         "not-shared-memory": "not seal", "a-pipe": "not a shared-memory file",
         "fewer-fds-than-declared": "memfds arrived", "too-many-fds": "more than 8 descriptors", "encoded": "raw only",
         "placed-out-of-range": "placed memfds"}


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_grant_is_refused_before_a_byte_is_read_and_leaks_no_descriptor(case, tmp_path):
    """Unsealed or shrinkable memfds, regions past the end or overlapping, files that are not shared
    memory, descriptor counts that disagree, an encoded payload: an error, the buffer untouched, every fd closed."""
    path = str(tmp_path / "hostile.sock")
    into = [torch.full((1, 2, 33, 8), 7.0)]

    async def run() -> None:
        ready = asyncio.Event()
        sender = asyncio.create_task(_hostile_sender(case, path, ready))
        await ready.wait()
        client = make_client("shm")
        try:
            await client.pull(path, PullRequest(context_id="ctx", items=[PullItem(0, "K")]), into, lambda *a: None, 10)
        finally:
            await client.close()
            await sender

    before = _open_fds()
    with pytest.raises((IntegrityError, BadMessageError), match=CASES[case]):
        asyncio.run(run())
    assert _open_fds() == before
    assert bool((into[0] == 7.0).all())  # bitwise: the fill nothing overwrote
