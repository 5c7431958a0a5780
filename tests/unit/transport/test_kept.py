"""`KeptMemfds`: a receiver's mappings of a sender's placed memfds, by the memfd's own identity,
kept only when that costs nothing but address space, dropped when released, by another
incarnation, beyond the count or byte budget, and never unmapped under a reader that still holds
the view."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os

import pytest
import torch

from droidmesh.shared.transport import memfd
from droidmesh.shared.transport.shm.kept import KeptMemfds, identity


@pytest.fixture
def memfds():
    """Sealed memfds of 4 KiB, each filled with its own byte value; closed after the test."""
    made: list[int] = []

    def make(value: int, nbytes: int = 4096, seals: int = memfd.SEALS) -> int:
        fd = os.memfd_create("droidmesh-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, bytes([value]) * nbytes, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        made.append(fd)
        return fd

    yield make
    for fd in made:
        os.close(fd)


def test_a_kept_memfd_is_found_by_its_identity_and_reads_its_bytes(memfds):
    kept = KeptMemfds()
    kept.update("one", [])
    a, b = memfds(1), memfds(2)
    assert kept.get(identity(a)) is None
    kept.keep(a, identity(a))
    view = kept.get(identity(a))
    assert view is not None and view.numel() == 4096 and bool((view == 1).all())  # bitwise: filled bytes
    assert kept.get(identity(b)) is None and kept.mapped == 1


def test_released_inodes_and_another_incarnation_drop_mappings(memfds):
    kept = KeptMemfds()
    kept.update("one", [])
    a, b = memfds(1), memfds(2)
    for fd in (a, b):
        kept.keep(fd, identity(fd))
    kept.update("one", [identity(a).inode, 12345])  # an inode never kept is ignored
    assert kept.get(identity(a)) is None and kept.get(identity(b)) is not None
    kept.update("two", [])  # the sender restarted: nothing of the old one stays mapped
    assert len(kept) == 0


def test_beyond_the_count_or_the_bytes_the_least_recently_used_go(memfds):
    kept = KeptMemfds(max_kept=2)
    fds = [memfds(i) for i in range(3)]
    kept.keep(fds[0], identity(fds[0]))
    kept.keep(fds[1], identity(fds[1]))
    assert kept.get(identity(fds[0])) is not None  # now the most recently used
    kept.keep(fds[2], identity(fds[2]))
    assert kept.inodes() == {identity(fds[0]).inode, identity(fds[2]).inode}
    by_bytes = KeptMemfds(max_bytes=3 * 4096)
    big = memfds(9, nbytes=2 * 4096)
    for fd in (fds[0], fds[1], big):
        by_bytes.keep(fd, identity(fd))
    assert by_bytes.inodes() == {identity(fds[1]).inode, identity(big).inode}
    huge = memfds(8, nbytes=4 * 4096)
    by_bytes.keep(huge, identity(huge))  # over the whole budget: never kept, nothing dropped for it
    assert by_bytes.inodes() == {identity(fds[1]).inode, identity(big).inode}


def test_only_a_fully_allocated_memfd_sealed_against_growth_is_kept(memfds, tmp_path):
    """A memfd that may grow, one with holes (a copy out of a hole would allocate the page, charged
    to the receiver) and a file that is no memfd of the shmem mount are read with preadv every time."""
    growable = memfds(3, seals=memfd.NEEDED_SEALS)
    holes = os.memfd_create("droidmesh-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(holes, 1 << 20)
    os.pwrite(holes, b"x" * 4096, 0)
    fcntl.fcntl(holes, fcntl.F_ADD_SEALS, memfd.SEALS)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    os.pwrite(plain, b"y" * 4096, 0)
    try:
        assert identity(memfds(4)).keepable
        for fd in (growable, holes, plain):
            assert not identity(fd).keepable
            kept = KeptMemfds()
            kept.keep(fd, identity(fd))
            assert len(kept) == 0
    finally:
        os.close(holes)
        os.close(plain)


def test_a_mapping_that_fails_is_logged_and_left_out(memfds, monkeypatch):
    """Keeping is best effort: out of descriptors or address space, the pull has its bytes anyway."""
    def refuse(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(mmap, "mmap", refuse)
    kept = KeptMemfds()
    fd = memfds(5)
    kept.keep(fd, identity(fd))
    assert len(kept) == 0 and kept.mapped == 0


def test_a_dropped_mapping_stays_readable_while_a_reader_holds_its_view(memfds):
    """Nothing unmaps explicitly: a copy that holds the view reads it safely after the drop, and
    the mapping goes with the last view."""
    kept = KeptMemfds()
    fd = memfds(7)
    kept.keep(fd, identity(fd))
    view = kept.get(identity(fd))
    kept.close()
    gc.collect()
    assert view is not None and bool((view == 7).all())  # bitwise: filled bytes
    out = torch.empty(4096, dtype=torch.uint8)
    out.copy_(view)
    assert bool((out == 7).all())  # bitwise: copied bytes


def test_an_empty_memfd_or_a_budget_of_zero_keeps_nothing(memfds):
    fd = memfds(1, nbytes=0)
    kept = KeptMemfds()
    kept.keep(fd, identity(fd))
    off = KeptMemfds(max_bytes=0)
    other = memfds(2)
    off.keep(other, identity(other))
    assert len(kept) == 0 and len(off) == 0
