"""Known-answer tests for every task metric."""

from __future__ import annotations

import math

import pytest
import torch

from droidmesh.shared.tasks import measures as M


def test_normalize_answer_drops_case_punctuation_articles() -> None:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    assert M.normalize_answer("The  Cat, a DOG!") == "cat dog"


@pytest.mark.parametrize(
    ("pred", "gold", "want"),
    [
        ("amber", ["amber"], 1.0),
        ("amber .", ["amber"], 1.0),
        ("basil", ["amber"], 0.0),
        ("amber basil", ["amber"], 2 * 0.5 * 1.0 / 1.5),  # precision 1/2, recall 1
        ("north south east", ["north east"], 0.8),  # p 2/3, r 1 -> 0.8
        ("basil", ["amber", "basil"], 1.0),  # max over gold answers
        ("", ["amber"], 0.0),
    ],
)
def test_token_f1_known_answers(pred: str, gold: list[str], want: float) -> None:
    """Token F1 equals the hand-computed value, max over gold answers."""
    assert M.token_f1(pred, gold) == pytest.approx(want)


def test_rouge_l_known_answers() -> None:
    """Rouge-L F: identical 1.0, disjoint 0.0, LCS 2 of (3 pred, 4 gold) -> 2*(2/3*2/4)/(2/3+2/4)."""
    assert M.rouge_l("north south east", ["north south east"]) == pytest.approx(1.0)
    assert M.rouge_l("amber", ["north"]) == 0.0
    p, r = 2 / 3, 2 / 4
    assert M.rouge_l("north x east", ["north south east west"]) == pytest.approx(2 * p * r / (p + r))


def test_edit_similarity_known_answers() -> None:
    """Edit similarity is rapidfuzz ratio/100 on the first non-comment line."""
    assert M.edit_similarity("return x", ["return x"]) == 1.0
    assert M.edit_similarity("# note\nreturn x\nmore", ["return x"]) == 1.0
    # ratio = 2*matches/(len a + len b): "abcd" vs "abce" -> 2*3/8
    assert M.edit_similarity("abcd", ["abce"]) == pytest.approx(0.75)
    assert M.edit_similarity("", ["abc"]) == 0.0


def test_score_rejects_unknown_metric() -> None:
    """An unknown metric name is an error, not a silent zero."""
    with pytest.raises(ValueError, match="unknown metric"):
        M.score("bleu", "a", ["a"])


def test_answer_nll_known_answer() -> None:
    """Uniform logits over V tokens give NLL log V; a one-hot-ish logit gives ~0."""
    V = 8
    assert M.answer_nll(torch.zeros(3, V), [1, 2, 3]) == pytest.approx(math.log(V))
    sharp = torch.full((1, V), -100.0)
    sharp[0, 5] = 100.0
    assert M.answer_nll(sharp, [5]) == pytest.approx(0.0, abs=1e-6)


def test_kl_divergence_known_answer() -> None:
    """KL(P||Q) of two explicit 2-point distributions matches the closed form; KL(P||P)=0."""
    p = torch.tensor([[math.log(0.5), math.log(0.5)]])
    q = torch.tensor([[math.log(0.9), math.log(0.1)]])
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert M.kl_divergence(p, q) == pytest.approx(want, rel=1e-5)
    assert M.kl_divergence(q, q) == pytest.approx(0.0, abs=1e-7)


def test_top1_agreement_known_answer() -> None:
    """Top-1 agreement counts positions whose argmax matches: 2 of 3 here."""
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    oth = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    assert M.top1_agreement(ref, oth) == pytest.approx(2 / 3)


def test_edit_similarity_scores_an_indentation_only_line() -> None:
    """LongBench's rule keeps a whitespace-only first line: 4 spaces vs `    x` -> 2*4/9."""
    assert M.edit_similarity("\n    \nreturn", ["    x"]) == pytest.approx(8 / 9)
    assert M.edit_similarity("a = 1  # set\nb = 2", ["b = 2"]) == 1.0


def test_answer_nll_builds_its_targets_on_the_logits_device() -> None:
    """The gold ids go where the logits are, not to the default device (here: meta, where a
    tensor built without a device would land and fail to mix with CPU logits)."""
    logits = torch.log(torch.tensor([[0.5, 0.5]]))
    with torch.device("meta"):
        got = M.answer_nll(logits, [0])
    assert got == pytest.approx(math.log(2))


def test_metric_names_are_the_metrics() -> None:
    """The names commands offer (`--metric`) are exactly the metrics `score` knows."""
    from droidmesh.shared.tasks.spec import METRIC_NAMES

    assert tuple(M.METRICS) == METRIC_NAMES


def test_greedy_agreement_counts_positions_of_the_longer_answer() -> None:
    from droidmesh.shared.tasks.measures import greedy_agreement

    assert greedy_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert greedy_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # two answer tokens missing
    assert greedy_agreement([1, 2], [1, 9, 9, 9]) == 0.25
    assert greedy_agreement([], []) == 1.0
