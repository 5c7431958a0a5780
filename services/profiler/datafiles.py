"""Data files an operator's profile request names: read only as regular files under the
profiler's data root, in bounded chunks up to a size cap, then copied into the request's own
temporary directory, so the profiling code never opens a path a request named.

The walk from the root opens one component at a time relative to its parent and follows no
symbolic link (a link swapped in meanwhile is refused, not followed), and checks that the last
one is a regular file before opening it, so a device, a FIFO or a socket is never opened, let
alone read. Every refusal of a name (no data root, outside the root, a link, missing, not a
regular file, unreadable) is the same `NOT_ALLOWED` message: a reply never tells whether a path
exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.tasks.jsonl import JsonlError, validate_row, write_jsonl
from droidmesh.shared.tasks.spec import known_tasks
from droidmesh.shared.wire import schemas

NOT_ALLOWED = "not allowed (data files are regular files under the profiler's data root)"
CHUNK_BYTES = 1 << 20


def _parts(root: str, name: str) -> tuple[str, ...] | None:
    """`name`'s components below `root` (a name relative to it, or absolute inside it); None when
    it is empty, climbs out ('..') or is absolute elsewhere."""
    if not root or not name or "\x00" in name:
        return None
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute():
        for base in {os.path.abspath(root), os.path.realpath(root)}:
            prefix = PurePosixPath(base).parts
            if parts[:len(prefix)] == prefix:
                parts = parts[len(prefix):]
                break
        else:
            return None
    if not parts or ".." in parts:
        return None
    return parts


def _open_regular(root: str, parts: tuple[str, ...]) -> int | None:
    """A read-only descriptor of the regular file `root/parts`, or None; no link is followed."""
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        at = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            inner = os.open(part, nofollow | os.O_DIRECTORY, dir_fd=at)
            os.close(at)
            at = inner
        before = os.stat(parts[-1], dir_fd=at, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            return None
        fd = os.open(parts[-1], nofollow | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=at)
    except OSError:
        return None
    finally:
        os.close(at)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(opened.st_mode):
        os.close(fd)  # replaced between the check and the open
        return None
    return fd


def read_data_file(root: str, name: str, field: str, max_bytes: int) -> bytes:
    """The bytes of data file `name` (see the module docstring); `field` names it in errors."""
    parts = _parts(root, name)
    fd = _open_regular(root, parts) if parts is not None else None
    if fd is None:
        raise BadRequestError(f"{field}: {NOT_ALLOWED}")
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise BadRequestError(f"{field}: larger than the profiler's cap of {max_bytes} bytes for a data file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(CHUNK_BYTES, max_bytes + 1 - size)):  # a file growing meanwhile stops at the cap
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise BadRequestError(f"{field}: larger than the profiler's cap of {max_bytes} bytes for a data file")
        return b"".join(chunks)
    except OSError:
        raise BadRequestError(f"{field}: {NOT_ALLOWED}") from None
    finally:
        os.close(fd)


def parse_rows(data: bytes, field: str, limit: int) -> list[dict[str, Any]]:
    """The first `limit` rows of JSONL `data`, each checked; errors name `field` and the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonlError(f"{field}: not UTF-8 text") from None
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise JsonlError(f"{field}:{lineno}: invalid JSON ({e.msg})") from None
        rows.append(validate_row(row, f"{field}:{lineno}"))
    if not rows:
        raise JsonlError(f"{field}: no rows")
    return rows


@dataclasses.dataclass(frozen=True)
class Staged:
    """A request's data as the profiling code takes it: copies in the request's directory."""

    data_train: str | None = None
    data_test: str | None = None
    other_tasks: list[str] | None = None


def stage(req: schemas.ProfileRequest, root: str, max_bytes: int, into: Path) -> Staged:
    """Copy the data files `req` names (data_train, data_test, and robustness tasks that are not
    zoo tasks) into directory `into`, keeping only the rows the profile will use."""
    def copy(name: str, field: str, limit: int, to: Path) -> str:
        write_jsonl(to, parse_rows(read_data_file(root, name, field, max_bytes), field, limit))
        return str(to)

    train = copy(req.data_train, "data_train", req.n_train, into / "train.jsonl") if req.data_train else None
    test = copy(req.data_test, "data_test", req.n_test, into / "test.jsonl") if req.data_test else None
    others = None
    if req.other_tasks is not None:
        zoo = set(known_tasks())
        # a file keeps its base name: the robustness check names its task after the file's stem
        others = [t if t in zoo else copy(t, f"other_tasks[{i}]", req.n_test, into / f"other-{i}" / PurePosixPath(t).name)
                  for i, t in enumerate(req.other_tasks)]
    return Staged(train, test, others)
