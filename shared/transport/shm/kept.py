"""The receiver's mappings of a sender's placed memfds, kept from one pull to the next.

A placed memfd holds one stored context, sealed against write and shrink: its bytes never change
and its pages never go while anyone holds it. `preadv` pays the kernel's per-page cost on every
pull (one thread reaches about half of memcpy on 4 KiB pages); a mapping pays it once, at its
first faults, and a copy out of it then runs at memcpy speed. So the client reads a placed memfd
the first time a connection's grant passes it with `preadv` (a fresh mapping's faults cost more
than that read), maps it afterwards, and copies out of the mapping on later pulls: contexts pulled
again and again (a shared document under many requests and fine-tunes) move at memory speed.

* Keyed by the memfd's own identity (`fstat`: device and inode), never by a number the sender
  gives: while we map a file it cannot go, so no other file can have its inode. A grant must still
  pass the memfd for every pull that reads it (and the client checks its seals and size each
  time), so a mapping serves only pulls the sender granted, and only within the bytes it granted.
* Dropped when a grant names its inode in `released_memfds` (the sender let that context go: its
  memory returns only once we unmap), when the sender's incarnation changes, least recently used
  beyond LIMIT, and all when the connection goes.
* A dropped mapping is unmapped when the last copy reading it is done: each copy task holds the
  view it reads (`source`), and nothing here closes a mapping explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import warnings

import torch

LIMIT = 64  # mappings kept per connection (one per placed context; each holds a descriptor)


@dataclasses.dataclass(frozen=True)
class Identity:
    """A passed memfd as the kernel names it, and its size now."""

    device: int
    inode: int
    nbytes: int


def identity(fd: int) -> Identity:
    st = os.fstat(fd)
    return Identity(st.st_dev, st.st_ino, st.st_size)


class KeptMemfds:
    """One connection's kept mappings: inode -> (identity, uint8 [nbytes] read-only view)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._incarnation: str | None = None
        self._maps: collections.OrderedDict[int, tuple[Identity, torch.Tensor]] = collections.OrderedDict()
        self.mapped = 0  # how many times a memfd was mapped: once per placed context, whatever the pulls

    def update(self, incarnation: str, released: list[int]) -> None:
        """A grant's news, before any of its regions is read: another incarnation drops every
        mapping (the old sender's memory returns); released inodes are dropped."""
        if incarnation != self._incarnation:
            self.close()
            self._incarnation = incarnation
        for inode in released:
            self._maps.pop(inode, None)

    def get(self, ident: Identity) -> torch.Tensor | None:
        """The kept view of this memfd, or None when it is not mapped (or has another size now)."""
        held = self._maps.get(ident.inode)
        if held is None or held[0] != ident:
            return None
        self._maps.move_to_end(ident.inode)
        return held[1]

    def keep(self, fd: int, ident: Identity) -> None:
        """Map `fd` (read-only, shared) for the pulls after this one; the least recently used
        mapping beyond the limit is dropped."""
        if ident.nbytes == 0 or self._limit == 0:
            return
        mm = mmap.mmap(fd, ident.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # holds its own descriptor
        with warnings.catch_warnings():  # read-only on purpose: only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mm, dtype=torch.uint8)  # [nbytes]; unmapped when the last view dies
        self._maps[ident.inode] = (ident, view)
        self._maps.move_to_end(ident.inode)
        self.mapped += 1
        while len(self._maps) > self._limit:
            self._maps.popitem(last=False)

    def __len__(self) -> int:
        return len(self._maps)

    def inodes(self) -> set[int]:
        return set(self._maps)

    def close(self) -> None:
        self._maps.clear()
