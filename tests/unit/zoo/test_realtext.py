"""The real tier's rows: real text only, split by source so no test context is ever trained on."""

from __future__ import annotations

import pytest

from droidmesh.shared.tasks.realtext import REAL_TASKS, make_real_rows, man_pages, split_of, stdlib_modules
from droidmesh.shared.tasks.rows import encode_row
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows


@pytest.mark.parametrize("task", REAL_TASKS)
def test_train_and_test_rows_come_from_disjoint_sources(task: str) -> None:
    if task == "doc_summary" and not man_pages()["test"]:
        pytest.skip("no manual pages installed on this machine")
    train, test = make_real_rows(task, "train", 12), make_real_rows(task, "test", 12)
    assert {r["source_file"] for r in train}.isdisjoint({r["source_file"] for r in test})
    assert all(split_of(r["source_file"]) == r["split"] for r in train + test)
    assert not {r["context"] for r in train} & {r["context"] for r in test}
    assert make_real_rows(task, "test", 12) == test  # deterministic
    assert make_rows(task, "test", 12, SuiteShape()) == test  # the zoo's one entry point dispatches here


def test_doc_qa_answer_is_the_documented_name_and_its_sentence_is_in_the_context() -> None:
    for row in make_real_rows("doc_qa", "test", 8):
        sentence = row["input"].split('"')[1]
        name = row["answers"][0]
        entry = next(e for e in row["context"].split("\n\n") if sentence.split()[0] in e and name.split(".")[-1] in e)
        assert entry  # the quoted docstring is in the context, under the name that answers
        assert f"{name}(" in row["context"]


def test_doc_summary_context_lacks_its_name_section() -> None:
    if not man_pages()["test"]:
        pytest.skip("no manual pages installed on this machine")
    for row in make_real_rows("doc_summary", "test", 6):
        assert "NAME" not in row["context"].split("\n", 3)[:3]
        assert row["answers"][0] and "\\f" not in row["context"]  # roff font escapes are gone


def test_real_rows_encode_with_an_answer() -> None:
    """Every row yields context, question and a non-empty gold answer through the one row encoder."""
    from droidmesh.shared.zoo.tokenizer import WordIds

    ids = WordIds()
    for task in REAL_TASKS:
        if task == "doc_summary" and not man_pages()["test"]:
            continue
        row = make_real_rows(task, "test", 1)[0]
        ctx, _, ans = encode_row(ids, row, task_spec(task))
        assert len(ctx) > 100 and ans


def test_unknown_task_or_split_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown real-text task"):
        make_real_rows("poetry", "test", 1)
    with pytest.raises(ValueError, match="split"):
        make_real_rows("doc_qa", "dev", 1)


@pytest.mark.parametrize("task", ["doc_qa", "code_completion/real"])
def test_heldout_rows_come_from_sources_neither_train_nor_test_reads(task: str) -> None:
    """`heldout`: the stdlib's packages, disjoint from the modules train and test draw from;
    a row names its module by its path below the library, so same-named files stay apart."""
    pools = stdlib_modules()
    assert pools["heldout"] and not set(pools["heldout"]) & (set(pools["train"]) | set(pools["test"]))
    rows = make_real_rows(task, "heldout", 24)
    assert all("/" in r["source_file"] and r["split"] == "heldout" for r in rows)
    assert not any("/test/" in f"/{r['source_file']}" or "site-packages" in r["source_file"] for r in rows)
    train_contexts = {r["context"] for r in make_real_rows(task, "train", 24) + make_real_rows(task, "test", 24)}
    assert not {r["context"] for r in rows} & train_contexts
    assert make_rows(task, "heldout", 24, SuiteShape()) == rows  # deterministic, through the zoo's entry point


def test_heldout_is_refused_where_a_task_has_no_such_sources() -> None:
    with pytest.raises(ValueError, match="no heldout sources"):
        make_real_rows("doc_summary", "heldout", 1)
    with pytest.raises(ValueError, match="train and test only"):
        make_rows("multihop_qa", "heldout", 1, SuiteShape())
