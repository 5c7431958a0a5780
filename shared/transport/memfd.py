"""Sealed shared memory for the bulk channels: placing a sender's stored context in one memfd
(the shm channel passes it; ucx and nixl sandboxes map it), finding where a stored tensor lies,
and the receiver's check of a memfd it is passed.

Sequence of a placement (`place`, the sender's torch thread, once per stored context):
  1. lay the tensors out back to back (per layer K, V, then E; each 64-byte aligned);
  2. write them into a new memfd through a writable mapping advised to use huge pages, then
     unmap it (F_SEAL_WRITE needs no writable mapping left);
  3. seal it against write, shrink and grow (and further sealing): its bytes never change and
     its pages never go away while anyone holds it;
  4. map it read-only and return views of that mapping; the memfd is registered under the
     mapping's address until the last view dies, when it is unmapped and closed.
A placed context costs two descriptors (the memfd, and the mapping's own duplicate).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import resource
import warnings
import weakref
from collections.abc import Iterable, Sequence

import structlog
import torch

from droidmesh.shared.transport.seals import NEEDED_SEALS as NEEDED_SEALS  # re-exported: receivers check with them
from droidmesh.shared.transport.seals import sealed_size as sealed_size

log = structlog.get_logger("memfd")

ALIGN = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    fd: int
    nbytes: int
    inode: int  # the memfd's own identity (fstat), which a receiver keeping it mapped knows it by


# mapping base address -> its memfd; an entry lives as long as some tensor views the mapping
_SEGMENTS: dict[int, Segment] = {}
_LIVE: set[int] = set()  # the inodes of those memfds (a grant's `released_memfds` names the gone)


def place(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` (one stored context's, `CapturedContext.items()` order) copied into one sealed
    memfd and returned as read-only views of it; CUDA tensors or an empty context are returned
    as they are (pulls of those go through per-pull copies). Blocks: the sender's torch thread."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total == 0:
        return list(tensors)
    fd = sealed_memfd(total, zip(offsets, tensors, strict=True))
    try:
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    with warnings.catch_warnings():  # read-only on purpose: a stored tensor is never written
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(mm, dtype=torch.uint8)  # [total]; keeps `mm` alive while any view lives
    key, seg = base.data_ptr(), Segment(fd, total, os.fstat(fd).st_ino)
    _SEGMENTS[key] = seg
    _LIVE.add(seg.inode)
    weakref.finalize(mm, _forget, key, seg)  # the last view gone: unmapped, then the memfd closed
    return [base[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors, strict=True)]


def _forget(key: int, seg: Segment) -> None:
    """Drop `seg` (its mapping is gone) and close its memfd. CPython unmaps before it runs this, so
    another placement may already own the address: only `seg`'s own entry is removed."""
    if _SEGMENTS.get(key) is seg:
        del _SEGMENTS[key]
    _LIVE.discard(seg.inode)  # the memfd still holds its inode here: no new placement can have it yet
    os.close(seg.fd)


def live(inode: int) -> bool:
    """Whether a placed memfd of this process with `inode` still holds its context."""
    return inode in _LIVE


def sealed_memfd(nbytes: int, parts: Iterable[tuple[int, torch.Tensor]]) -> int:
    """A memfd of `nbytes` holding each (offset, tensor)'s bytes, sealed. The bytes go in through
    a writable mapping advised to use huge pages (taken where the host's shmem THP setting allows:
    `advise`, `within_size` or `always`; a read then costs one page lookup per 2 MiB, not per
    4 KiB), which is unmapped before sealing: F_SEAL_WRITE needs no writable mapping left."""
    fd = os.memfd_create("droidmesh-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            mm.madvise(mmap.MADV_HUGEPAGE)
            dest = torch.frombuffer(mm, dtype=torch.uint8)  # [nbytes]
            for offset, t in parts:
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
                dest[offset:offset + flat.numel()].copy_(flat)
            del dest  # the mapping's only export: it must be gone before the mapping closes
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_thp() -> str:
    """The host's shmem transparent-huge-page mode (the bracketed word of THP_SETTING), or "unknown"."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def placed(t: torch.Tensor) -> tuple[Segment, int] | None:
    """(its memfd, its offset there) when `t` is a contiguous view of a placed mapping."""
    if not t.is_cpu or not t.is_contiguous():
        return None
    storage = t.untyped_storage()
    key = storage.data_ptr()
    seg = _SEGMENTS.get(key)
    offset = t.data_ptr() - key
    # the storage must be the whole mapping (one of `place`'s views), not other memory that a
    # new allocation put at an address a mapping being torn down still names
    if seg is None or storage.nbytes() != seg.nbytes or not 0 <= offset <= seg.nbytes - t.nbytes:
        return None
    return seg, offset


def raise_fd_limit() -> None:
    """Lift this process's soft descriptor limit to its hard limit: each placed context holds two
    (its memfd, its mapping's). Servers that place call it at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("fd_limit_raised", soft=soft, now=hard)
