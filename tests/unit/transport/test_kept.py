"""`KeptMemfds`: a receiver's mappings of a sender's placed memfds, by the memfd's own identity,
dropped when released, by another incarnation, beyond the limit or when the size changed, and
never unmapped under a reader that still holds the view."""

from __future__ import annotations

import fcntl
import gc
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


def test_beyond_the_limit_the_least_recently_used_goes(memfds):
    kept = KeptMemfds(limit=2)
    fds = [memfds(i) for i in range(3)]
    kept.keep(fds[0], identity(fds[0]))
    kept.keep(fds[1], identity(fds[1]))
    assert kept.get(identity(fds[0])) is not None  # now the most recently used
    kept.keep(fds[2], identity(fds[2]))
    assert kept.inodes() == {identity(fds[0]).inode, identity(fds[2]).inode}


def test_a_memfd_that_grew_is_not_read_through_its_old_mapping(memfds):
    """A hostile sender's memfd sealed against write and shrink only may grow: the old mapping
    no longer covers its size, so it is a miss (read with preadv and mapped again)."""
    kept = KeptMemfds()
    fd = memfds(3, seals=memfd.NEEDED_SEALS)
    kept.keep(fd, identity(fd))
    os.ftruncate(fd, 8192)
    assert kept.get(identity(fd)) is None
    kept.keep(fd, identity(fd))
    assert kept.get(identity(fd)).numel() == 8192  # type: ignore[union-attr]


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


def test_an_empty_memfd_or_a_limit_of_zero_keeps_nothing(memfds):
    fd = memfds(1, nbytes=0)
    kept = KeptMemfds()
    kept.keep(fd, identity(fd))
    off = KeptMemfds(limit=0)
    other = memfds(2)
    off.keep(other, identity(other))
    assert len(kept) == 0 and len(off) == 0
