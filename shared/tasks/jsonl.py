"""LongBench-style JSONL: one object per line with `context`, `input`, `answers` (+ extras).

The loader is strict: a malformed row names its line number, so a user's dataset fails loudly
before any model runs instead of silently scoring garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import BadRequestError

REQUIRED = ("context", "input", "answers")


class JsonlError(BadRequestError):
    """A JSONL dataset row is malformed; the message starts with `path:line:`."""

    code = "bad_dataset"


def validate_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise JsonlError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise JsonlError(f"{where}: missing field(s) {', '.join(missing)}")
    for k in ("context", "input"):
        if not isinstance(row[k], str):
            raise JsonlError(f"{where}: field {k!r} must be a string")
    answers = row["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise JsonlError(f"{where}: field 'answers' must be a non-empty list of strings")
    return row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All rows of `path`; blank lines are skipped, anything else malformed raises JsonlError."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JsonlError(f"{where}: invalid JSON ({exc.msg})") from None
            rows.append(validate_row(row, where))
    if not rows:
        raise JsonlError(f"{path}: no rows")
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows (validated) one per line; return the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows, start=1):
            validate_row(row, f"row {i}")
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
            n += 1
    return n
