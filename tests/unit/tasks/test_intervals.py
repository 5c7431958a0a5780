"""Intervals and the 5 % rule on constructed rows: Wilson's known values; a paired difference
that the rows pin down is `within` or `below`; one they cannot pin down is `undecided`, even
when its mean alone would pass or fail; the same rows give the same interval."""

from __future__ import annotations

import pytest

from droidmesh.shared.tasks.intervals import paired, wilson


def test_wilson_matches_known_values_and_stays_in_bounds():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 10)[0] == pytest.approx(0.0) and wilson(10, 10)[1] == pytest.approx(1.0)
    lo, hi = wilson(10, 10)
    assert 0.69 < lo < 0.73  # all correct on 10 trials is still not certainty
    assert wilson(0, 0) == (0.0, 1.0)


def test_the_same_answers_on_every_row_are_within():
    ref = [0.2, 0.9, 0.5, 1.0] * 12
    p = paired(ref, list(ref))
    assert p.diff == 0 and p.lo == 0 and p.hi == 0 and p.verdict() == "within"


def test_a_plan_that_loses_a_third_on_every_row_is_below():
    ref = [0.6, 0.9, 0.3, 0.75] * 12
    p = paired(ref, [r * 2 / 3 for r in ref])
    assert p.rel == pytest.approx(-1 / 3) and p.rel_hi is not None and p.rel_hi < -0.05 and p.verdict() == "below"


def test_a_mean_inside_the_rule_on_few_noisy_rows_is_undecided():
    """One row of eight differs by a whole answer: the mean (-4 %) alone would pass the 5 % rule,
    but its interval reaches far below it."""
    ref = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] * 2 + [1.0] * 5
    other = list(ref)
    other[1] = 0.0
    p = paired(ref, other)
    assert -0.05 < p.rel < 0 and p.rel_lo is not None and p.rel_lo < -0.05 and p.verdict() == "undecided"


def test_a_gain_by_noise_is_not_a_win():
    """Eight rows, a plan right where full prefill was wrong on one and wrong where it was right on
    none: its mean is higher, but the interval of its gain includes 0."""
    ref = [1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0]
    other = [1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0]
    p = paired(ref, other)
    assert p.diff > 0 and p.lo <= 0 <= p.hi


def test_the_interval_is_reproducible_and_the_rows_must_pair():
    ref, other = [0.1, 0.5, 0.9, 0.4] * 5, [0.2, 0.4, 0.9, 0.5] * 5
    assert paired(ref, other) == paired(ref, other)
    with pytest.raises(ValueError):
        paired(ref, other[:-1])
    assert paired([0.0] * 4, [1.0] * 4).verdict() == "undecided"  # nothing to be within 5 % of


def test_rows_of_one_document_are_resampled_together():
    """Ten documents of four rows each, the plan losing all four rows of two of them: resampled
    by document the interval is wider than resampled by row (the rows were never independent)."""
    ref = [1.0] * 40
    other = [0.0] * 8 + [1.0] * 32
    docs = [i // 4 for i in range(40)]
    by_row, by_doc = paired(ref, other), paired(ref, other, groups=docs)
    assert by_row.diff == by_doc.diff == pytest.approx(-0.2)
    assert by_doc.hi - by_doc.lo > by_row.hi - by_row.lo
    with pytest.raises(ValueError):
        paired(ref, other, groups=docs[:-1])
