"""A committed tier's weight files, kept packed (xz) in the repository and unpacked where used.

The working tree travels with every GPU call, which carries 64 MiB in all (`infra/gpu/carry.py`),
and trained weights pack to about 0.7 of their size (their exponent bytes repeat). So a committed
file `F` may be kept as `F.xz` (lzma's xz format, Python's own `lzma`: no new dependency); a
tier's manifest names and hashes `F`'s own bytes either way. `copy_out` writes a copy (as it is, or
packed) where a tier is built, unpacked, atomically, and only if its bytes are the ones the
manifest hashes; `matching` finds such a copy; `pack` makes the packed file of a refreshed one.
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


def _open(path: Path) -> IO[bytes]:
    """A reader of the file's unpacked bytes."""
    return lzma.open(path, "rb") if path.name.endswith(SUFFIX) else path.open("rb")


def _unpack(path: Path, out: IO[bytes] | None = None) -> str:
    """sha256 of the file's unpacked bytes, each written to `out` as it is read; a packed file that
    does not unpack raises lzma's error (or EOFError, truncated)."""
    h = hashlib.sha256()
    with _open(path) as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
    return h.hexdigest()


def sha256_of(path: Path) -> str | None:
    """sha256 of the file's unpacked bytes; None for a packed file that does not unpack (damaged,
    truncated, or not xz at all: a Git LFS pointer, say)."""
    try:
        return _unpack(path)
    except (lzma.LZMAError, EOFError):
        return None


def matching(d: Path, name: str, want: str) -> Path | None:
    """The copy of `name` in `d` whose unpacked bytes hash to `want`, or None (none does: missing,
    damaged, or another version's)."""
    return next((path for path in copies(d, name) if sha256_of(path) == want), None)


def _atomic(to: Path, write: Callable[[IO[bytes]], bool], mode_of: Path) -> bool:
    """`write` into a temporary file beside `to`, renamed into place when it returns True (else
    dropped): a reader never sees part of it, and an interrupted or refused write leaves `to` as it
    was. Its mode is `mode_of`'s (mkstemp makes a file its owner's only)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=to.parent, prefix=f".{to.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            keep = write(out)
        if keep:
            shutil.copymode(mode_of, tmp)
            os.replace(tmp, to)
            return True
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    Path(tmp).unlink(missing_ok=True)
    return False


def copy_out(path: Path, to: Path, want: str | None = None) -> bool:
    """`path`'s unpacked bytes (a file as it is, or packed) written at `to`, hashed as they are
    written: with `want`, put in place only if their sha256 is `want` (False, `to` untouched,
    otherwise: other bytes, or a pack that does not unpack). One pass over the bytes: a check
    first would unpack them twice."""
    def write(out: IO[bytes]) -> bool:
        try:
            got = _unpack(path, out)
        except (lzma.LZMAError, EOFError):
            if want is None:
                raise
            return False  # damaged: not the bytes wanted
        return want is None or got == want

    return _atomic(to, write, path)


def pack(path: Path) -> Path:
    """`path` packed beside it as `path.xz` (`path` stays: where it is git-ignored, the tier it
    belongs to stays loadable); the packed file's path."""
    packed = path.with_name(path.name + SUFFIX)

    def write(out: IO[bytes]) -> bool:
        with path.open("rb") as fh, lzma.open(out, "wb", preset=6) as xz:
            shutil.copyfileobj(fh, xz, CHUNK)
        return True

    _atomic(packed, write, path)
    return packed
