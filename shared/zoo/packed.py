"""A committed tier's weight files, kept packed (xz) in the repository and unpacked where used.

The working tree travels with every GPU call, which carries 64 MiB in all (`infra/gpu/carry.py`),
and trained weights pack to about 0.7 of their size (their exponent bytes repeat). So a committed
file `F` may be kept as `F.xz` (lzma's xz format, Python's own `lzma`: no new dependency); a
tier's manifest names and hashes `F`'s own bytes either way. `matching` finds the copy (as it is,
or packed) whose unpacked bytes are the ones the manifest hashes, `copy_out` writes it where a
tier is built (unpacking, atomically), `pack` makes the packed file of a refreshed one.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

SUFFIX = ".xz"
CHUNK = 1 << 20


def copies(d: Path, name: str) -> list[Path]:
    """The copies of `name` that `d` holds: as it is, packed, both or none."""
    return [path for path in (d / name, d / (name + SUFFIX)) if path.is_file()]


def unpacked_name(path: Path) -> str:
    """The name a file stands for: `F` for `F.xz`."""
    return path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name


def _open(path: Path) -> IO[bytes]:
    """A reader of the file's unpacked bytes."""
    return lzma.open(path, "rb") if path.name.endswith(SUFFIX) else path.open("rb")


def sha256_of(path: Path) -> str | None:
    """sha256 of the file's unpacked bytes; None for a packed file that does not unpack (damaged,
    truncated, or not xz at all: a Git LFS pointer, say)."""
    h = hashlib.sha256()
    try:
        with _open(path) as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                h.update(chunk)
    except (lzma.LZMAError, EOFError):
        return None
    return h.hexdigest()


def matching(d: Path, name: str, want: str) -> Path | None:
    """The copy of `name` in `d` whose unpacked bytes hash to `want`, or None (none does: missing,
    damaged, or another version's)."""
    return next((path for path in copies(d, name) if sha256_of(path) == want), None)


def _atomic(to: Path, write: Callable[[IO[bytes]], None], mode_of: Path) -> None:
    """`write` into a temporary file beside `to`, renamed into place: a reader never sees part of
    it, and an interrupted write leaves `to` as it was. Its mode is `mode_of`'s (mkstemp makes a
    file its owner's only)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=to.parent, prefix=f".{to.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        shutil.copymode(mode_of, tmp)
        os.replace(tmp, to)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_out(path: Path, to: Path) -> None:
    """`path`'s unpacked bytes (a file as it is, or packed) written at `to`."""
    def write(out: IO[bytes]) -> None:
        with _open(path) as fh:
            shutil.copyfileobj(fh, out, CHUNK)

    _atomic(to, write, path)


def pack(path: Path) -> Path:
    """`path` packed beside it as `path.xz` (`path` stays: where it is git-ignored, the tier it
    belongs to stays loadable); the packed file's path."""
    packed = path.with_name(path.name + SUFFIX)

    def write(out: IO[bytes]) -> None:
        with path.open("rb") as fh, lzma.open(out, "wb", preset=6) as xz:
            shutil.copyfileobj(fh, xz, CHUNK)

    _atomic(packed, write, path)
    return packed
