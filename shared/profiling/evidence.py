"""Whether a profile's rows can support a choice at all, and whether the choice holds on the test split.

A profile chooses the fewest recomputed layers within `tolerance` of the receiver's full
prefill. Two kinds of rows make that choice empty, however long the search runs:

  near zero        the receiver's own full prefill scores below MIN_FULL_PREFILL: there is no
                   quality to preserve, so every plan is "within 5 %" (the rows, the metric or
                   the answer length do not measure this task for this receiver);
  indistinguishable  the receiver's full prefill, full reuse of the sender's KV and the sender
                   answering alone score the same on every row: the metric cannot tell paths
                   apart, so no group can be shown to matter.

Both are checked on the first plans a profile scores, before the search (`require_signal`),
and are errors, not results. The test split then checks the choice (`test_interval`): the 5 %
rule applied to the paired difference's 95 % interval, "undecided" when the rows cannot tell. It
is reported and carried in the published config; `check_publishable` is the one rule on it that
`droidmesh config publish` (without `--force`) and the profiler service apply before publishing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from droidmesh.shared.errors import BadRequestError, NoSignalError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.tasks import intervals

if TYPE_CHECKING:
    from droidmesh.shared.wire.schemas import RecomputeConfig

MIN_FULL_PREFILL = 0.05  # mean task score in [0, 1]; below it the receiver cannot do the task on these rows
SAME = 1e-9  # scores closer than this are the same score (floating-point means of equal answers)


@runtime_checkable
class RowScores(Protocol):
    """A quality oracle that also gives per-row scores (`tasks.scorer.PairScorer`)."""

    def scores(self, plan: ReusePlan) -> list[float]: ...

    def sender_scores(self) -> list[float]: ...


def require_scores(split: str, full_prefill: float) -> None:
    """NoSignalError when the receiver's full prefill on `split` scores near zero."""
    if full_prefill < MIN_FULL_PREFILL:
        raise NoSignalError(
            f"the receiver's own full prefill scores {full_prefill:.3f} on the {split} rows (< {MIN_FULL_PREFILL}): "
            "there is no quality to preserve, any plan would pass; check the rows, --metric and --max-new-tokens")


def require_paths_differ(split: str, oracle: object) -> None:
    """NoSignalError when full prefill, full reuse and the sender alone score alike on every row
    of `split`. Only an oracle with per-row scores is checked (means may agree by chance)."""
    if not isinstance(oracle, RowScores):
        return
    rows = zip(oracle.scores(ReusePlan.full_prefill()), oracle.scores(ReusePlan.full_reuse()),
               oracle.sender_scores(), strict=True)
    if all(max(r) - min(r) <= SAME for r in rows):
        raise NoSignalError(
            f"the metric scores the receiver's full prefill, full reuse and the sender alone the same on every "
            f"{split} row: it cannot tell paths apart, so no layer group can be shown to matter; use other rows "
            "or another --metric")


def passes_test(chosen_test: float, full_prefill_test: float, tolerance: float) -> bool:
    """The profile's rule on the test split's means, for a profile without per-row scores (one
    written before intervals): the chosen plan within `tolerance` of full prefill."""
    return chosen_test >= (1.0 - tolerance) * full_prefill_test


PASSES = {"within": True, "below": False, "undecided": None}  # a verdict as `passes_test`: None = the rows cannot tell


def test_interval(oracle: object, plan: ReusePlan, tolerance: float) -> dict[str, Any] | None:
    """The rule applied to an interval: `plan` against the receiver's full prefill on the same test
    rows, the paired relative difference with its bootstrap 95 % interval (rows of one document
    resampled together) and the verdict (`intervals.Paired.verdict`): "within" when the whole
    interval is above -tolerance, "below" when it is all under, else "undecided". None for an
    oracle without per-row scores."""
    if not isinstance(oracle, RowScores):
        return None
    groups = getattr(oracle, "documents", None)
    p = intervals.paired(oracle.scores(ReusePlan.full_prefill()), oracle.scores(plan), groups=groups)
    return {"rows": p.rows, "documents": len(set(groups)) if groups is not None else p.rows, "rel": p.rel,
            "rel_lo": p.rel_lo, "rel_hi": p.rel_hi, "verdict": p.verdict(tolerance)}


def test_line(passes: bool | None, verdict: str | None, interval: list[float] | None, rows: int | None,
              tolerance: float) -> str:
    """How a chosen plan fared on the test split, in a few words (the CLI, the profiler's refusal)."""
    if verdict is None:
        return {True: "holds on test", False: "FAILS on test", None: "not checked on test"}[passes]
    span = f"[{interval[0]:+.1%}, {interval[1]:+.1%}]" if interval else "no interval (full prefill scores 0)"
    words = {"within": "holds on test", "below": "FAILS on test", "undecided": "undecided on test"}[verdict]
    return f"{words}: {span} against full prefill, 95 % over {rows} rows, rule -{tolerance:.0%}"


def unpublishable(cfg: RecomputeConfig) -> str | None:
    """Why `cfg` must not be published, or None when its chosen plan is not shown to fail the rule
    on the profile's test split: its interval all below the tolerance, or, for a profile without
    per-row scores, its means. An undecided interval, or a config made before the check (no
    test qualities), is publishable: the config says so."""
    if cfg.passes_test is not False:
        return None
    if cfg.test_verdict is not None:
        return "the chosen plan " + test_line(cfg.passes_test, cfg.test_verdict, cfg.test_interval, cfg.test_rows,
                                              cfg.tolerance)

    def q(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (f"the chosen plan fails the test split (test {q(cfg.chosen_quality_test)} < {1 - cfg.tolerance:g} x "
            f"full prefill {q(cfg.full_prefill_quality_test)})")


def check_publishable(cfg: RecomputeConfig, what: str, then: str) -> None:
    """`BadRequestError` ("<what>: <the failure>; <then>") when `unpublishable` refuses `cfg`:
    receivers would serve a plan the held-out rows reject."""
    failure = unpublishable(cfg)
    if failure is not None:
        raise BadRequestError(f"{what}: {failure}; {then}")
