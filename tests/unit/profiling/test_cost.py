"""A profile's cost, said before it starts, and the work that fits a budget."""

from __future__ import annotations

import pytest

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import cost, search
from droidmesh.shared.profiling.profile import ProfileSettings, run

L30 = 30  # the 30-layer model of the issue: defaults announced 167 configurations, 6 h 53 min for 8+8 rows


def oracle30(plan: ReusePlan) -> float:
    """Layers 20 and 22 matter (0.3 each when reused); every extra group start costs 0.02."""
    if plan.mode == "full_prefill":
        return 1.0
    recomputed = set(plan.recomputed_layers(L30))
    return max(0.0, 1.0 - 0.3 * len({20, 22} - recomputed) - 0.02 * max(0, len(plan.groups) - 1))


def test_announcement_states_plans_rows_minutes_and_the_measured_time():
    """The line says ~plans x train rows, the rest in row-evaluations, the total in minutes and
    the measured seconds per row-evaluation, and the total is their product."""
    work = cost.Work("guided", False, 8, 8, others=(8, 8), transfer=True)
    per_train, total = cost.row_evaluations(work, L30, 2)
    line = cost.announce(work, L30, 2, cost.Timing(14.6, 14.6, 14.6))
    assert line.startswith(f"profile: ~{per_train} evaluations × 8 rows + {total - 8 * per_train} row-evaluations")
    assert f"≈ {cost.duration(total * 14.6)}" in line and "measured per row: full prefill 14.60 s" in line
    assert "\n" not in line
    assert [cost.duration(s) for s in (40, 64, 12 * 60, 413 * 60)] == ["40 s", "1.1 min", "12 min", "6 h 53 min"]


def test_the_default_search_grows_linearly_in_layers_the_exhaustive_one_quadratically():
    """At 30 layers on a 2-layer grid the old default (exhaustive + guided) scores ~170 plans per
    train row; the default (guided) under 50; coarse-to-fine about 20. Doubling L doubles the
    guided count at most and adds a few plans to the coarse one."""
    def plans(search_kind: str, exhaustive: bool, layers: int) -> int:
        return cost.train_evaluations(cost.Work(search_kind, exhaustive, 1, 1), layers, 2)

    assert plans("guided", True, L30) >= 167 and plans("guided", False, L30) <= 50 and plans("coarse", False, L30) <= 22
    assert ProfileSettings().search == "guided" and not ProfileSettings().exhaustive
    for layers in (30, 60, 120):
        assert plans("guided", False, 2 * layers) <= 2 * plans("guided", False, layers)
        assert plans("coarse", False, 2 * layers) <= plans("coarse", False, layers) + 4
    assert plans("guided", True, 60) > 3 * plans("guided", True, 30)  # the quadratic one


@pytest.mark.parametrize("search_kind,exhaustive,layers", [("guided", False, 8), ("guided", True, 8), ("coarse", False, 8),
                                                           ("guided", False, L30), ("coarse", False, L30),
                                                           ("coarse", True, L30)])
def test_the_announced_plan_count_bounds_what_the_profile_scores(search_kind, exhaustive, layers):
    """The estimate never under-counts: the distinct train plans `run` scores are at most the
    announced count (so a budget it fits is kept)."""
    seen: set[ReusePlan] = set()

    def counting(plan: ReusePlan) -> float:
        seen.add(plan)
        return oracle30(plan) if layers == L30 else (1.0 if plan.mode == "full_prefill" else 0.5 + 0.05 * len(
            plan.recomputed_layers(layers)))

    run(counting, counting, layers, ProfileSettings(search=search_kind, exhaustive=exhaustive))
    assert len(seen) <= cost.train_evaluations(cost.Work(search_kind, exhaustive, 1, 1), layers, 2)


def test_coarse_to_fine_finds_the_guided_group_with_fewer_plans():
    """On the 30-layer oracle the coarse search (4 blocks, then binary search on both ends)
    chooses the group the guided search chooses, [20, 24), in fewer than half its plans."""
    guided = run(oracle30, oracle30, L30, ProfileSettings())
    coarse = run(oracle30, oracle30, L30, ProfileSettings(search="coarse"))
    assert (coarse["chosen"]["start"], coarse["chosen"]["end"]) == (guided["chosen"]["start"], guided["chosen"]["end"]) \
        == (20, 24)
    assert coarse["evaluations"]["coarse"] <= search.coarse_evaluations(L30, 2)
    assert coarse["evaluations"]["coarse"] < (guided["evaluations"]["guided"] + guided["evaluations"]["sensitivity"]) / 2
    assert coarse["scattered_critical"] is None and coarse["sensitivity"] == []


def test_plans_are_charged_by_the_layers_they_compute():
    """Full prefill, reuse and capture timed alike: the estimate is row-evaluations x that time.
    Reuse cheap (a CPU's long prefill): full-prefill plans cost full, full reuse the reuse time,
    and a sensitivity-free coarse search costs less per plan than the guided one."""
    work = cost.Work("guided", False, 8, 8, others=(8,), transfer=True)
    assert cost.seconds(work, L30, 2, cost.Timing(2.0, 2.0, 2.0)) == 2.0 * cost.row_evaluations(work, L30, 2)[1]
    timing = cost.Timing(1.0, 0.1, 0.5)
    assert timing.plan_s(1.0) == 1.0 and timing.plan_s(0.0) == 0.1 and timing.plan_s(0.5) == pytest.approx(0.55)
    guided, coarse = (cost.Work(k, False, 1, 0) for k in ("guided", "coarse"))

    def per_plan(w: cost.Work) -> float:
        return cost.seconds(w, L30, 2, timing) / cost.row_evaluations(w, L30, 2)[1]

    assert per_plan(coarse) < per_plan(guided) < 1.0


def test_a_budget_the_work_fits_changes_nothing():
    work = cost.Work("guided", True, 50, 50, others=(50,), transfer=True)
    timing = cost.Timing(0.01, 0.002, 0.003)
    assert cost.fit(work, L30, 2, timing, cost.seconds(work, L30, 2, timing)) == (work, [])


def test_a_budget_cuts_the_comparison_robustness_search_transfer_then_rows_in_that_order():
    """Each cut is taken only while the work is still over budget; the result fits, and rows
    shrink last, never below MIN_ROWS."""
    work = cost.Work("guided", True, 50, 50, others=(50, 50), transfer=True)
    row_s = cost.Timing(1.0, 0.2, 0.3)  # a CPU: reuse plans cost a fifth of full prefill
    no_exhaustive = cost.Work("guided", False, 50, 50, others=(50, 50), transfer=True)
    fitted, cut = cost.fit(work, L30, 2, row_s, cost.seconds(no_exhaustive, L30, 2, row_s))
    assert fitted == no_exhaustive and cut == ["the exhaustive comparison"]

    smallest = cost.Work("coarse", False, 50, 50)
    budget = cost.seconds(smallest, L30, 2, row_s) / 3
    fitted, cut = cost.fit(work, L30, 2, row_s, budget)
    assert cut[:4] == ["the exhaustive comparison", "the robustness data sets",
                       "the guided search (coarse-to-fine instead)", "the transfer search"]
    assert cut[4].startswith("rows (50 + 50 -> ")
    assert (fitted.search, fitted.exhaustive, fitted.others, fitted.transfer) == ("coarse", False, (), False)
    assert cost.MIN_ROWS <= fitted.n_train < 50 and cost.seconds(fitted, L30, 2, row_s) <= budget


def test_a_budget_nothing_fits_is_refused_in_one_line():
    """Even the coarse search on MIN_ROWS rows over budget: one line naming --budget and the cheapest profile's time."""
    work = cost.Work("guided", False, 8, 8, others=(8,), transfer=True)
    with pytest.raises(BadRequestError) as e:
        cost.fit(work, L30, 2, cost.Timing(14.6, 14.6, 14.6), 60.0)
    msg = str(e.value)
    assert "--budget 1 min is too short" in msg and "coarse search" in msg and "8 train + 8 test rows" in msg
    assert "\n" not in msg


def test_the_row_timed_is_the_median_one_scaled_to_the_mean():
    """A long first row (the code task's first train row is its longest, 2,772 tokens) is not the
    one timed: the row of median length is, and the timing is scaled by mean / median, so the
    estimate is the rows' mean cost where a row costs its length."""
    rows = [{"n": n} for n in (2772, 800, 1000, 1200, 1400)]
    row, scale = cost.typical_row(rows, lambda r: r["n"])
    assert row["n"] == 1200 and scale == pytest.approx(7172 / 5 / 1200)
    timing = cost.Timing(2.0, 1.0, 0.5).scaled(scale)
    assert timing.full_s == pytest.approx(2.0 * scale) and timing.capture_s == pytest.approx(0.5 * scale)
    assert cost.typical_row([{"n": 0}], lambda r: r["n"]) == ({"n": 0}, 1.0)  # an empty prompt: timed as it is
    with pytest.raises(ValueError):
        cost.typical_row([], lambda r: 1)
