"""Rows that cannot support a choice are an error before the search; the test split checks the choice."""

from __future__ import annotations

import pytest

from droidmesh.shared.errors import NoSignalError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling.profile import ProfileSettings, recompute_config, run

L = 8


def oracle(plan: ReusePlan) -> float:
    """Layers 4 and 6 matter: the chosen group is [4, 8)."""
    if plan.mode == "full_prefill":
        return 1.0
    return max(0.0, 1.0 - 0.3 * len({4, 6} - set(plan.recomputed_layers(L))) - 0.02 * max(0, len(plan.groups) - 1))


class Rows:
    """A quality oracle with per-row scores, as `PairScorer` has them; records every plan asked."""

    def __init__(self, receiver: dict[str, list[float]], sender: list[float]):
        self.receiver, self.sender, self.asked = receiver, sender, []

    def scores(self, plan: ReusePlan) -> list[float]:
        self.asked.append(plan)
        return self.receiver.get(plan.mode, [oracle(plan)] * len(self.sender))

    def sender_scores(self) -> list[float]:
        return self.sender

    def __call__(self, plan: ReusePlan) -> float:
        s = self.scores(plan)
        return sum(s) / len(s)


def test_near_zero_full_prefill_is_an_error_before_the_search():
    """The receiver's own full prefill scoring 0.01: NoSignalError, and no other plan scored."""
    asked: list[ReusePlan] = []

    def hopeless(plan: ReusePlan) -> float:
        asked.append(plan)
        return 0.01

    with pytest.raises(NoSignalError, match=r"full prefill scores 0\.010 on the train rows"):
        run(hopeless, oracle, L, ProfileSettings())
    assert asked == [ReusePlan.full_prefill()]


def test_near_zero_on_the_test_split_is_an_error_too():
    with pytest.raises(NoSignalError, match="on the test rows"):
        run(oracle, lambda plan: 0.0, L, ProfileSettings())


def test_a_metric_that_cannot_tell_paths_apart_is_an_error_before_the_search():
    """Full prefill, full reuse and the sender alone scoring the same on every row (0.6 and 0.4):
    NoSignalError before any sensitivity probe or group is scored."""
    same = [0.6, 0.4, 0.6]
    train = Rows({"full_prefill": same, "full_reuse": same}, sender=same)
    with pytest.raises(NoSignalError, match="cannot tell paths apart"):
        run(train, oracle, L, ProfileSettings())
    assert {p.mode for p in train.asked} == {"full_prefill", "full_reuse"}


def test_paths_differing_on_one_row_are_enough():
    """The same means but one row differs (the sender alone gets row 2 wrong): the profile runs."""
    same = [0.6, 0.4, 0.6]
    train = Rows({"full_prefill": same, "full_reuse": same}, sender=[0.6, 0.4, 0.0])
    assert run(train, oracle, L, ProfileSettings())["chosen"]["recomputed_layers"] == 0


def test_require_signal_off_profiles_anyway():
    """The profiler service (and `droidmesh profile --allow-no-signal`) may profile untrained models."""
    result = run(lambda plan: 0.0, lambda plan: 0.0, L, ProfileSettings(require_signal=False))
    assert result["full_prefill"]["quality_train"] == 0.0 and result["chosen"]["passes_test"]


@pytest.mark.parametrize("chosen_on_test,passes", [(0.96, True), (0.94, False)])
def test_the_chosen_group_is_checked_on_the_test_split_and_the_config_carries_it(chosen_on_test, passes, tmp_path):
    """The choice ([4, 8), made on train) scoring below 0.95 x full prefill on the test split is
    marked failed in the profile and in its RecomputeConfig, with both test qualities."""

    def test(plan: ReusePlan) -> float:
        return chosen_on_test if plan == ReusePlan.recompute(4, 8) else oracle(plan)

    result = run(oracle, test, L, ProfileSettings(), pair=Pair("s", "r", "t"))
    assert (result["chosen"]["start"], result["chosen"]["end"]) == (4, 8)
    assert result["chosen"]["passes_test"] is passes
    cfg = recompute_config(result, ModelRef(tmp_path / "s", "s", "ci", "a" * 64), ModelRef(tmp_path / "r", "r", "ci", "b" * 64), 1)
    assert (cfg.chosen_quality_test, cfg.full_prefill_quality_test, cfg.passes_test) == (chosen_on_test, 1.0, passes)


def _test_rows(chosen: list[float], documents: list[str] | None = None) -> Rows:
    """A test split of per-row scores: full prefill answers every row; the chosen group [4, 8) `chosen`."""
    n = len(chosen)

    class TestRows(Rows):
        def scores(self, plan: ReusePlan) -> list[float]:
            return chosen if plan == ReusePlan.recompute(4, 8) else [oracle(plan)] * n

    rows = TestRows({}, sender=[0.0] * n)
    if documents is not None:
        rows.documents = documents  # type: ignore[attr-defined]
    return rows


@pytest.mark.parametrize("chosen,verdict,passes", [
    ([1.0] * 40, "within", True),  # every row kept: the interval is [0, 0]
    ([1.0] * 20 + [0.0] * 20, "below", False),  # half the rows lost: -50 %, all of the interval under -5 %
    ([1.0] * 37 + [0.0] * 3, "undecided", None),  # 3 of 40 lost: -7.5 %, the interval straddles -5 %
])
def test_the_rule_is_applied_to_the_test_interval_and_undecided_says_so(chosen, verdict, passes, tmp_path):
    """Per-row test scores: the chosen plan's paired difference to full prefill with its 95 %
    interval decides; one that straddles the rule is reported undecided (neither holds nor fails),
    and the config carries the interval, the rows and the verdict."""
    result = run(oracle, _test_rows(chosen), L, ProfileSettings(), pair=Pair("s", "r", "t"))
    check = result["chosen"]["test_interval"]
    assert check["verdict"] == verdict and check["rows"] == 40 and result["chosen"]["passes_test"] is passes
    assert check["rel_lo"] <= check["rel"] <= check["rel_hi"]
    cfg = recompute_config(result, ModelRef(tmp_path / "s", "s", "ci", "a" * 64), ModelRef(tmp_path / "r", "r", "ci", "b" * 64), 1)
    assert (cfg.test_verdict, cfg.passes_test, cfg.test_rows) == (verdict, passes, 40)
    assert cfg.test_interval == [check["rel_lo"], check["rel_hi"]]
    from droidmesh.shared.profiling.job import chosen_test_line

    line = chosen_test_line(result)
    assert line.startswith({"within": "holds", "below": "FAILS", "undecided": "undecided"}[verdict]) and "40 rows" in line


def test_rows_of_one_document_widen_the_interval():
    """The same 3 lost rows out of 40, the 40 rows asking about 4 documents: a document's rows are
    resampled together, so the interval is wider than over 40 independent rows."""
    from droidmesh.shared.profiling import evidence

    chosen = [1.0] * 37 + [0.0] * 3
    alone = evidence.test_interval(_test_rows(chosen), ReusePlan.recompute(4, 8), 0.05)
    grouped = evidence.test_interval(_test_rows(chosen, [f"d{i // 10}" for i in range(40)]), ReusePlan.recompute(4, 8), 0.05)
    assert alone is not None and grouped is not None and grouped["documents"] == 4
    assert grouped["rel_hi"] - grouped["rel_lo"] > alone["rel_hi"] - alone["rel_lo"]
