"""The check of a memfd passed by another process: a regular file sealed against writes and
shrinking, so its bytes cannot change and its pages cannot go while it is read. Torch-free: the
sandbox processes check what their sender passes with it, receivers what a sender passes."""

from __future__ import annotations

import fcntl
import os
import stat

from droidmesh.shared.errors import DroidMeshError, IntegrityError

NEEDED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK  # what a reader requires before reading


def sealed_size(fd: int, error: type[DroidMeshError] = IntegrityError) -> int:
    """The size of a memfd sealed against write and shrink; `error` for anything else."""
    return sealed_stat(fd, error)[0].st_size


def sealed_stat(fd: int, error: type[DroidMeshError] = IntegrityError) -> tuple[os.stat_result, int]:
    """(its `fstat`, its seals) for a memfd sealed against write and shrink; `error` for anything
    else. The `fstat` is taken after the seals are seen, so its size can no longer shrink."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise error("a passed descriptor is not a shared-memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise error("a passed descriptor is not sealable shared memory") from None
    if seals & NEEDED_SEALS != NEEDED_SEALS:
        raise error(f"a passed memfd is not sealed against write and shrink (seals {seals:#x})")
    return os.fstat(fd), seals
