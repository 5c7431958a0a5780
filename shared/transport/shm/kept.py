"""The receiver's mappings of a sender's placed memfds, kept from one pull to the next.

A placed memfd holds one stored context, sealed against write, shrink and grow: its bytes never
change and its pages never go while anyone holds it. `preadv` pays the kernel's per-page cost on
every pull (one thread reaches about half of memcpy on 4 KiB pages); a mapping pays it once, at
its first faults, and a copy out of it then runs at memcpy speed. So the client reads a placed
memfd the first time a connection's grant passes it with `preadv` (a fresh mapping's faults cost
more than that read), maps it afterwards, and copies out of the mapping on later pulls: contexts
pulled again and again (a shared document under many requests and fine-tunes) move at memory speed.

* Keyed by the memfd's own identity (`fstat`: device and inode), never by a number the sender
  gives. Only memfds of the kernel's own shmem mount are kept (the device a memfd of ours has; a
  hugetlb memfd is read with `preadv` every time), on Linux 5.9 or later: that mount numbers its
  inodes with a 64-bit counter that never repeats while the host is up, and while we map a file
  it cannot go anyway. A grant must still pass the memfd for every pull that reads it (seals and
  size are checked each time), so a mapping serves only pulls the sender granted, and only within
  the bytes it granted.
* Kept only when mapping it costs the receiver nothing but address space: sealed against growth
  too, every page already allocated (a copy out of a hole would allocate the page, charged to
  us), and within the connection's byte budget; anything else is read with `preadv` every time.
* Dropped when a grant names its inode in `released_memfds` (the sender let that context go: its
  memory returns only once we unmap), when the sender's incarnation changes, when the connection
  has been idle for the client's `MAPPINGS_IDLE_S` (a release reaches us only with a grant),
  least recently used beyond MAX_KEPT mappings or the byte budget, and all when the connection
  goes.
* A dropped mapping is unmapped when the last copy reading it is done: each copy task holds the
  view it reads (`source`), and nothing here closes a mapping explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import mmap
import os
import platform
import warnings

import structlog
import torch

log = structlog.get_logger("shm")

MAX_KEPT = 64  # mappings per connection (one per placed context; each holds a descriptor)
MAX_BYTES = 16 << 30  # their bytes per connection: address space, and the sender's memory they pin


def _shmem_device() -> int | None:
    """The device of a memfd of ours (the kernel's shmem mount), where inode numbers are unique;
    None where they may repeat (Linux before 5.9: 32-bit, wrapping) or memfds are not there."""
    release = platform.release().split(".")
    try:
        if (int(release[0]), int(release[1].split("-")[0])) < (5, 9):
            return None
        fd = os.memfd_create("droidmesh-probe", os.MFD_CLOEXEC)
    except (ValueError, IndexError, OSError, AttributeError):
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


SHMEM_DEVICE = _shmem_device()


@dataclasses.dataclass(frozen=True)
class Identity:
    """A passed memfd as the kernel names it, its size now, and whether it may be kept."""

    device: int
    inode: int
    nbytes: int
    keepable: bool


def identity(fd: int) -> Identity:
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not sealable: never kept (and refused before this by the seal check)
        seals = 0
    return identity_of(os.fstat(fd), seals)


def identity_of(st: os.stat_result, seals: int) -> Identity:
    """A memfd's identity from its `fstat` and its seals (`seals.sealed_stat`'s answer)."""
    populated = st.st_blocks * 512 >= st.st_size  # no hole a copy out of a mapping would fill
    grows = not seals & fcntl.F_SEAL_GROW
    return Identity(st.st_dev, st.st_ino, st.st_size, st.st_dev == SHMEM_DEVICE and populated and not grows)


class KeptMemfds:
    """One connection's kept mappings: (device, inode) -> (identity, uint8 [nbytes] read-only view)."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_kept: int = MAX_KEPT) -> None:
        self._max_bytes, self._max_kept = max_bytes, max_kept
        self._incarnation: str | None = None
        self._maps: collections.OrderedDict[tuple[int, int], tuple[Identity, torch.Tensor]] = collections.OrderedDict()
        self._bytes = 0
        self.mapped = 0  # how many times a memfd was mapped: once per placed context, whatever the pulls

    def update(self, incarnation: str, released: list[int]) -> None:
        """A grant's news, before any of its regions is read: another incarnation drops every
        mapping (the old sender's memory returns); released inodes (of the shmem mount) are dropped."""
        if incarnation != self._incarnation:
            self.close()
            self._incarnation = incarnation
        for inode in released:
            self._drop((-1 if SHMEM_DEVICE is None else SHMEM_DEVICE, inode))

    def get(self, ident: Identity) -> torch.Tensor | None:
        """The kept view of this memfd, or None when it is not mapped (or has another size now)."""
        key = (ident.device, ident.inode)
        held = self._maps.get(key)
        if held is None or held[0] != ident:
            return None
        self._maps.move_to_end(key)
        return held[1]

    def keep(self, fd: int, ident: Identity) -> None:
        """Map `fd` (read-only, shared) for the pulls after this one, when it may be kept and fits;
        the least recently used mappings make room. Best effort: a mapping that fails (out of
        descriptors or address space) is logged, and the memfd is read with `preadv` next time."""
        if not ident.keepable or not 0 < ident.nbytes <= self._max_bytes or self._max_kept == 0:
            return
        try:
            mm = mmap.mmap(fd, ident.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # holds its own descriptor
        except OSError as e:
            log.warning("shm_keep_failed", nbytes=ident.nbytes, error=f"{type(e).__name__}: {e}")
            return
        with warnings.catch_warnings():  # read-only on purpose: only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mm, dtype=torch.uint8)  # [nbytes]; unmapped when the last view dies
        key = (ident.device, ident.inode)
        self._drop(key)
        while self._maps and (len(self._maps) >= self._max_kept or self._bytes + ident.nbytes > self._max_bytes):
            self._drop(next(iter(self._maps)))
        self._maps[key] = (ident, view)
        self._bytes += ident.nbytes
        self.mapped += 1

    def _drop(self, key: tuple[int, int]) -> None:
        held = self._maps.pop(key, None)
        if held is not None:
            self._bytes -= held[0].nbytes

    def __len__(self) -> int:
        return len(self._maps)

    def inodes(self) -> set[int]:
        return {inode for _, inode in self._maps}

    def close(self) -> None:
        self._maps.clear()
        self._bytes = 0
