"""A committed tier's weight files, kept packed (xz) in the repository and unpacked where used.

The working tree travels with every GPU call, which carries 64 MiB in all (`infra/gpu/carry.py`),
and trained weights pack to about 0.7 of their size (their exponent bytes repeat). So a committed
file `F` may be kept as `F.xz` (lzma's xz format, Python's own `lzma`: no new dependency); a
tier's manifest names and hashes `F`'s own bytes either way. `sha256` hashes a file as it is
meant (unpacked), `copy_out` writes it where a tier is built (unpacking, atomically), `pack`
makes the packed file of a refreshed one.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO

SUFFIX = ".xz"
CHUNK = 1 << 20


def source(d: Path, name: str) -> Path | None:
    """Where `d` holds `name`: as it is, packed, or nowhere (None). The file as it is wins."""
    for path in (d / name, d / (name + SUFFIX)):
        if path.is_file():
            return path
    return None


def unpacked_name(path: Path) -> str:
    """The name a file stands for: `F` for `F.xz`."""
    return path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name


def _open(path: Path) -> IO[bytes]:
    """A reader of the file's unpacked bytes."""
    return lzma.open(path, "rb") if path.name.endswith(SUFFIX) else path.open("rb")


def sha256(d: Path, name: str) -> str | None:
    """sha256 of `name`'s unpacked bytes in `d`, or None when `d` holds it neither way; a packed
    file that does not unpack has no hash either (None: not intact)."""
    path = source(d, name)
    if path is None:
        return None
    h = hashlib.sha256()
    try:
        with _open(path) as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                h.update(chunk)
    except (lzma.LZMAError, EOFError):
        return None
    return h.hexdigest()


def copy_out(d: Path, name: str, to: Path) -> None:
    """`name`'s unpacked bytes from `d` written at `to` (a temporary file renamed into place: a
    reader never sees part of it)."""
    path = source(d, name)
    if path is None:
        raise FileNotFoundError(f"{d / name} (or {name}{SUFFIX})")
    to.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=to.parent, prefix=f".{to.name}.")
    try:
        with os.fdopen(fd, "wb") as out, _open(path) as fh:
            shutil.copyfileobj(fh, out, CHUNK)
        shutil.copymode(path, tmp)  # as readable as the committed file (mkstemp makes it the owner's only)
        os.replace(tmp, to)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pack(path: Path) -> Path:
    """`path` packed beside it as `path.xz` (which replaces `path`); the packed file's path."""
    packed = path.with_name(path.name + SUFFIX)
    with path.open("rb") as fh, lzma.open(packed, "wb", preset=6) as out:
        shutil.copyfileobj(fh, out, CHUNK)
    path.unlink()
    return packed
