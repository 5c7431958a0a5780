"""LongBench-style JSONL I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from droidmesh.shared.tasks.jsonl import JsonlError, read_jsonl, write_jsonl

GOOD = {"context": "anna amber .", "input": "ask anna", "answers": ["amber"]}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_roundtrip_keeps_rows_and_extra_fields(tmp_path: Path) -> None:
    """write_jsonl then read_jsonl returns the same rows, extra fields included."""
    rows = [dict(GOOD, _id="r1", length=3), dict(GOOD, input="ask bob")]
    write_jsonl(tmp_path / "d.jsonl", rows)
    assert read_jsonl(tmp_path / "d.jsonl") == rows


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    """Blank lines do not count as rows."""
    p = _write(tmp_path / "d.jsonl", [json.dumps(GOOD), "", json.dumps(GOOD)])
    assert len(read_jsonl(p)) == 2


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps([1, 2]), "expected a JSON object"),
        (json.dumps({"context": "c", "answers": ["a"]}), "missing field(s) input"),
        (json.dumps(dict(GOOD, answers="amber")), "'answers' must be a non-empty list"),
        (json.dumps(dict(GOOD, answers=[])), "'answers' must be a non-empty list"),
        (json.dumps(dict(GOOD, answers=[1])), "'answers' must be a non-empty list"),
        (json.dumps(dict(GOOD, context=5)), "'context' must be a string"),
    ],
)
def test_malformed_row_names_its_line(tmp_path: Path, bad: str, needle: str) -> None:
    """A malformed row raises JsonlError naming `path:line` (line 3 here) and the problem."""
    p = _write(tmp_path / "d.jsonl", [json.dumps(GOOD), json.dumps(GOOD), bad])
    with pytest.raises(JsonlError) as exc:
        read_jsonl(p)
    assert f"{p}:3:" in str(exc.value)
    assert needle in str(exc.value)


def test_empty_file_is_rejected(tmp_path: Path) -> None:
    """A dataset with no rows is an error."""
    p = _write(tmp_path / "d.jsonl", [""])
    with pytest.raises(JsonlError, match="no rows"):
        read_jsonl(p)
