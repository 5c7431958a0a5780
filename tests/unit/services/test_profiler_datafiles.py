"""An operator's data files (services/profiler/datafiles.py): regular files under the data root
only, read up to a cap; every other name gets one message, whether or not the path exists."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from droidmesh.services.profiler import datafiles
from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.tasks.jsonl import JsonlError, read_jsonl
from droidmesh.shared.wire import schemas

ROW = {"context": "c", "input": "q", "answers": ["a"]}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root holding rows.jsonl and sub/more.jsonl, beside a file outside it."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    text = "".join(json.dumps({**ROW, "context": f"c{i}"}) + "\n" for i in range(5))
    (root / "rows.jsonl").write_text(text)
    (root / "sub" / "more.jsonl").write_text(text)
    (tmp_path / "outside.jsonl").write_text(text)
    return root


def refusal(root: Path | str, name: str) -> str:
    with pytest.raises(BadRequestError) as e:
        datafiles.read_data_file(str(root), name, "data_train", 1 << 20)
    return str(e.value)


def test_regular_files_under_the_root_are_read(root):
    text = (root / "rows.jsonl").read_bytes()
    for name in ("rows.jsonl", "./rows.jsonl", str(root / "rows.jsonl"),
                 "sub/more.jsonl", str(root / "sub" / "more.jsonl")):
        assert datafiles.read_data_file(str(root), name, "data_train", 1 << 20) == text, name


def test_every_other_name_gets_the_same_message_as_a_missing_file(root, tmp_path):
    """Outside the root (existing or not), climbing out, links (escaping or not), devices, FIFOs,
    directories, no root at all: one message, so a reply never says whether a path exists."""
    os.symlink(tmp_path / "outside.jsonl", root / "escape.jsonl")
    os.symlink(root / "rows.jsonl", root / "inside-link.jsonl")
    os.symlink("/dev/zero", root / "zero.jsonl")
    os.symlink(tmp_path, root / "dir-link")
    os.mkfifo(root / "fifo.jsonl")  # opening it for reading would block without a writer
    expected = f"data_train: {datafiles.NOT_ALLOWED}"
    names = ["missing.jsonl", str(root / "missing.jsonl"), str(tmp_path / "outside.jsonl"), str(tmp_path / "nope.jsonl"),
             "../outside.jsonl", "sub/../../outside.jsonl", "/dev/zero", "/etc/passwd", "escape.jsonl",
             "inside-link.jsonl", "zero.jsonl", "dir-link/outside.jsonl", "fifo.jsonl", "sub", ".", "", "a\x00b"]
    assert {n: refusal(root, n) for n in names} == {n: expected for n in names}
    assert refusal("", "rows.jsonl") == expected  # no data root: no data files at all


def test_a_file_over_the_cap_is_refused_before_it_is_read(root):
    size = (root / "rows.jsonl").stat().st_size
    with pytest.raises(BadRequestError, match=f"larger than the profiler's cap of {size - 1} bytes"):
        datafiles.read_data_file(str(root), "rows.jsonl", "data_train", size - 1)
    assert len(datafiles.read_data_file(str(root), "rows.jsonl", "data_train", size)) == size


def test_rows_are_parsed_up_to_the_limit_and_errors_name_the_field_not_the_path():
    data = b"\n".join(json.dumps({**ROW, "context": f"c{i}"}).encode() for i in range(10)) + b"\nnot json\n"
    assert [r["context"] for r in datafiles.parse_rows(data, "data_test", 3)] == ["c0", "c1", "c2"]
    with pytest.raises(JsonlError, match=r"^data_test:11: invalid JSON"):
        datafiles.parse_rows(data, "data_test", 100)
    with pytest.raises(JsonlError, match="data_test: not UTF-8"):
        datafiles.parse_rows(b"\xff\xfe", "data_test", 3)
    with pytest.raises(JsonlError, match="data_test: no rows"):
        datafiles.parse_rows(b"\n\n", "data_test", 3)


def test_staging_copies_only_the_rows_used_and_keeps_zoo_tasks(root, tmp_path):
    req = schemas.ProfileRequest(request_id="r", sender_path="s", receiver_path="r", task="t", n_train=2, n_test=3,
                                 data_train="rows.jsonl", data_test="sub/more.jsonl",
                                 other_tasks=["multihop_qa", "sub/more.jsonl"])
    into = tmp_path / "req"
    into.mkdir()
    staged = datafiles.stage(req, str(root), 1 << 20, into)
    assert staged.data_train and len(read_jsonl(staged.data_train)) == 2
    assert staged.data_test and len(read_jsonl(staged.data_test)) == 3
    assert staged.other_tasks is not None and staged.other_tasks[0] == "multihop_qa"
    assert Path(staged.other_tasks[1]).name == "more.jsonl" and Path(staged.other_tasks[1]).is_relative_to(into)
    with pytest.raises(BadRequestError, match=r"other_tasks\[1\]: not allowed"):
        datafiles.stage(schemas.ProfileRequest(request_id="r", sender_path="s", receiver_path="r", task="t",
                                               other_tasks=["summarization", "/etc/passwd"]), str(root), 1 << 20, into)
