"""The zoo's task data generators."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.tasks.spec import TASKS, known_tasks, task_spec
from droidmesh.shared.tasks.suite import SuiteShape, code_row, make_rows, stdlib_files
from droidmesh.shared.tasks.synthetic import CODE, make_context

SMALL = SuiteShape(facts=(3, 6), docs=(2, 3), filler=(20, 40), code_tokens=120)


def test_code_is_a_derangement() -> None:
    """The receiver's code maps every value to a different value, bijectively."""
    assert sorted(CODE.values()) == sorted(V.VALUES)
    assert all(CODE[v] != v for v in V.VALUES)


def test_context_keys_unique_and_true_value_follows_header() -> None:
    """Keys are unique within a context; a coded context's facts mean CODE[written value]."""
    ctx = make_context(random.Random(0), 8, 3, 50, header=V.CODED)
    keys = [w for w in ctx.words if w in V.KEYS]
    assert len(keys) == len(set(keys)) == 8
    k = keys[0]
    assert ctx.true_value(k) == CODE[ctx.facts[k]]
    assert ctx.words[0] == V.CODED and ctx.words.count(V.DOC) == 3


def test_rows_are_deterministic_and_splits_differ() -> None:
    """Same (task, split, seed) -> same rows; train and test contexts differ."""
    for task in TASKS:
        a = make_rows(task, "test", 3, SMALL)
        assert a == make_rows(task, "test", 3, SMALL)
        train = {r["context"] for r in make_rows(task, "train", 3, SMALL)}
        assert not train & {r["context"] for r in a}


def test_multihop_row_answer_is_the_decoded_value_of_the_aliased_key() -> None:
    """The `who <alias>` answer is the aliased key's value, decoded when the header is coded."""
    for row in make_rows("multihop_qa", "test", 12, SMALL):
        alias = row["input"].split()[1]
        key = V.KEYS[V.ALIASES.index(alias)]
        words = row["context"].split()
        written = words[words.index(key) + 1]
        want = CODE[written] if row["header"] == V.CODED else written
        assert row["answers"] == [want]


def test_code_rows_come_from_the_split_files() -> None:
    """Code rows use real stdlib lines: the answer is the file's line after the context."""
    row = code_row(random.Random(1), "test", 120, 0)
    path = next(p for p in stdlib_files()["test"] if p.endswith("/" + row["source"]))
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    assert row["answers"] == [lines[row["line"] - 1]]
    assert row["context"].endswith(lines[row["line"] - 2] + "\n")
    assert not set(stdlib_files()["test"]) & set(stdlib_files()["train"])


def test_shifts_change_the_documented_part_of_the_shape() -> None:
    """A shift keeps the task's spec but moves its data: coded/plain fix the header, long
    contexts are longer than the task's own, and an unknown shift is a clear error."""
    base = make_rows("multihop_qa", "test", 6, SuiteShape())
    assert {r["header"] for r in make_rows("multihop_qa/coded", "test", 6, SuiteShape())} == {V.CODED}
    assert {r["header"] for r in make_rows("multihop_qa/plain", "test", 6, SuiteShape())} == {V.PLAIN}
    long = make_rows("multihop_qa/long", "test", 6, SuiteShape())
    assert min(r["length"] for r in long) > max(r["length"] for r in base)
    assert long[0]["task"] == "multihop_qa/long" and task_spec("multihop_qa/long") == TASKS["multihop_qa"]
    assert "code_completion/long" in known_tasks()
    with pytest.raises(ValueError, match="multihop_qa/nope"):
        make_rows("multihop_qa/nope", "test", 1, SuiteShape())
