"""Task specs and row encoding, apart from the zoo's data generators."""

from __future__ import annotations

import pytest

from droidmesh.shared.tasks.rows import answer_text, encode_row
from droidmesh.shared.tasks.spec import GENERIC, TASKS, known_tasks, shifts_of, task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.zoo.tokenizer import WordIds

SMALL = SuiteShape(facts=(3, 6), docs=(2, 3), filler=(20, 40), code_tokens=120)


def test_shift_scores_like_its_task_and_unknown_names_get_the_generic_spec() -> None:
    """A shift has its task's spec; a user's task name gets the generic spec under its name."""
    assert task_spec("multihop_qa/long") == TASKS["multihop_qa"]
    mine = task_spec("my_docs")
    assert mine.name == "my_docs" and (mine.metric, mine.max_new_tokens, mine.stop) == (
        GENERIC.metric, GENERIC.max_new_tokens, GENERIC.stop)
    assert shifts_of("multihop_qa")[0] == "multihop_qa/plain" and "code_completion/long" in known_tasks()


def test_overrides_replace_only_what_is_given() -> None:
    """--metric / --max-new-tokens / --stop replace the spec's fields; an unknown metric fails."""
    s = task_spec("my_docs", metric="rouge_l", stop=("###",))
    assert (s.metric, s.stop, s.max_new_tokens) == ("rouge_l", ("###",), GENERIC.max_new_tokens)
    assert task_spec("summarization", max_new_tokens=3).metric == "rouge_l"
    with pytest.raises(ValueError, match="bleu"):
        task_spec("my_docs", metric="bleu")


def test_answer_text_cuts_at_the_earliest_stop_string() -> None:
    """With several stop strings the answer ends at whichever comes first."""
    spec = task_spec("my_docs", stop=("\n", " ."))
    assert answer_text(" anna . amber\nx", spec) == "anna"
    assert answer_text(" anna\nbob .", spec) == "anna"
    assert answer_text("\n  x = 1", task_spec("code_completion")) == "  x = 1"


def test_leading_blank_lines_do_not_empty_the_answer() -> None:
    """Real instruct models open answers with blank lines: the stop string "\n" (the generic
    spec's default) ends the answer after them, not before (every answer scored empty)."""
    assert answer_text("\n\nThe capital is Paris.\nMore text", task_spec("my_docs")) == "The capital is Paris."
    assert answer_text("\n\n make_dataclass\n", task_spec("doc_qa")) == "make_dataclass"
    assert answer_text("\n\n    return x\n    y", task_spec("code_completion", stop=("\n",))) == "    return x"


def test_encode_row_tokenizes_answer_in_place() -> None:
    """Context gets <bos>; the gold answer ids are what follows the prompt in the joined text."""
    ids = WordIds()
    row = make_rows("multihop_qa", "test", 1, SMALL)[0]
    ctx, q, ans = encode_row(ids, row, TASKS["multihop_qa"])
    assert ctx[0] == ids.bos and ctx[1:] == ids.encode_text(row["context"])
    assert q == ids.encode_text(row["input"]) and ans == [ids[row["answers"][0]]]
    code = make_rows("code_completion", "test", 1, SMALL)[0]
    ctx, q, ans = encode_row(ids, code, TASKS["code_completion"])
    assert q == [] and ids.decode(ans) == code["answers"][0]
