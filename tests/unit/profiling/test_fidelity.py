"""The fidelity search on constructed rows: divergence ranks the plans, a sequential test on the
task metric chooses, and a plan that wins by noise is not chosen."""

from __future__ import annotations

import dataclasses
import random

import pytest

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling import fidelity
from droidmesh.shared.profiling.profile import ProfileSettings, recompute_config, run

N = 200
FAST = fidelity.Settings(probe_rows=8, batch=20, min_rows=40)


def rows_of(values: dict[ReusePlan, list[float]]):
    """A `scores(plan, n)` over fixed per-row values; records how many rows each plan was asked for."""
    asked: dict[ReusePlan, int] = {}

    def scores(plan: ReusePlan, n: int) -> list[float]:
        asked[plan] = max(asked.get(plan, 0), n)
        return values[plan][:n]
    return scores, asked


def binary(p: float, seed: int) -> list[float]:
    """N exact-match rows scoring 1 with probability p."""
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(N)]


FULL = ReusePlan.full_prefill()
SMALL, MID, LARGE = ReusePlan.recompute(6, 8), ReusePlan.recompute(4, 8), ReusePlan.recompute(2, 8)


def test_a_plan_that_wins_by_noise_is_not_chosen():
    """SMALL matches full prefill's mean (0.5 both) but its rows are independent coin flips, so its
    paired interval straddles the rule: undecided on every row, never chosen. MID equals full
    prefill on every row but one it loses: within, chosen."""
    full = binary(0.5, 1)
    noisy = binary(0.5, 2)
    mid = list(full)
    mid[next(i for i in range(150, N) if full[i])] = 0.0
    scores, _ = rows_of({FULL: full, SMALL: noisy, MID: mid, LARGE: full})
    result = fidelity.race([(SMALL, 2), (MID, 4), (LARGE, 6)], scores, N, None, FAST)
    verdicts = {e.plan: e.verdict for e in result.entries}
    assert abs(sum(noisy) - sum(full)) / sum(full) < 0.05  # its mean alone would pass the rule
    assert verdicts[SMALL] == "undecided" and verdicts[MID] == "within"
    assert result.chosen is not None and result.chosen.plan == MID


def test_a_plan_below_the_rule_leaves_early_and_its_rows_go_to_the_others():
    """SMALL loses 60 % of full prefill: dropped as soon as a verdict is allowed, long before the
    rows run out; larger plans are dropped once a smaller one is within (they cannot win)."""
    full = [1.0] * N
    scores, asked = rows_of({FULL: full, SMALL: [0.4 if i % 5 else 0.0 for i in range(N)], MID: full, LARGE: full})
    result = fidelity.race([(LARGE, 6), (SMALL, 2), (MID, 4)], scores, N, None, FAST)
    by = {e.plan: e for e in result.entries}
    assert by[SMALL].verdict == "below" and by[SMALL].dropped == "below the rule"
    assert asked[SMALL] == FAST.min_rows < N
    assert by[LARGE].dropped == "a smaller plan is within the rule"
    assert result.chosen is not None and result.chosen.plan == MID
    assert result.rows == FAST.min_rows  # MID was within at the first verdict: the race stopped there
    assert result.row_scores < 4 * N


def test_an_interval_that_straddles_the_rule_is_reported_undecided_and_not_chosen():
    """Every plan loses ~7 % with rows lost and gained: none is within, none below; the fallback
    names the one with the highest interval floor, and the race says it could not decide."""
    full = binary(0.6, 3)
    loses = [0.0 if i % 10 == 0 else 1.0 if i % 20 == 5 else x for i, x in enumerate(full)]
    scores, asked = rows_of({FULL: full, SMALL: loses, MID: loses})
    result = fidelity.race([(SMALL, 2), (MID, 4)], scores, N, None, FAST)
    assert result.chosen is None and {e.verdict for e in result.entries} == {"undecided"}
    assert asked[SMALL] == N  # the rows ran out before either could be decided
    fb = fidelity.fallback(result)
    assert fb is not None and fb.plan == SMALL  # same floor: fewer layers


def test_no_verdict_before_min_rows():
    """Identical rows give a zero-width interval at once; the race still waits for `min_rows`."""
    full = binary(0.5, 4)
    scores, asked = rows_of({FULL: full, SMALL: full})
    result = fidelity.race([(SMALL, 2)], scores, N, None, fidelity.Settings(batch=8, min_rows=32))
    assert result.chosen is not None and result.rows == 32 and asked[SMALL] == 32


def test_rank_shortlists_windows_that_remove_most_of_full_reuses_divergence():
    """Layers 4..7 carry the divergence (swap probes): the windows holding them come first; a window
    that leaves more than half of full reuse's divergence stays off the short list."""
    L = 8

    def divergence(plan: ReusePlan, n: int) -> list[float]:
        heavy = {4: 1.0, 5: 1.0, 6: 2.0, 7: 2.0}
        if plan.mode == "swap":
            return [heavy.get(plan.groups[0][0], 0.01)] * n
        if plan.mode == "full_reuse":
            return [6.0] * n
        kept = sum(v for l, v in heavy.items() if l not in plan.recomputed_layers(L))
        return [kept] * n

    ranked = fidelity.rank(divergence, L, 2, fidelity.Settings(probe_rows=4, shortlist=3))
    assert ranked.windows[0][:2] == (6, 8)  # the 2-layer window with the most divergence
    assert ranked.windows[1][:2] == (4, 8)
    # (6, 8) leaves 2 of 6 (kept 0.33 <= 0.5): on; (4, 8) leaves 0: on; larger ones beat nothing
    assert [p for p, _ in ranked.shortlist] == [ReusePlan.recompute(6, 8), ReusePlan.recompute(4, 8)]


class Scorer:
    """What the profile reads of a train or test split: per-row scores and divergences."""

    def __init__(self, n: int, seed: int):
        self.rows = list(range(n))
        self.documents = [i // 2 for i in range(n)]
        rng = random.Random(seed)
        self.base = [1.0 if rng.random() < 0.7 else 0.0 for _ in range(n)]

    def scores(self, plan: ReusePlan, rows: int | None = None) -> list[float]:
        n = len(self.rows) if rows is None else rows
        if plan.mode == "full_prefill":
            return self.base[:n]
        kept = 0 if plan.mode == "swap" else sum(1 for l in (4, 5) if l not in plan.recomputed_layers(8))
        return [0.0 if kept and i % (2 if kept == 2 else 4) == 0 else x for i, x in enumerate(self.base[:n])]

    def divergences(self, plan: ReusePlan, rows: int | None = None) -> list[float]:
        n = len(self.rows) if rows is None else rows
        if plan.mode == "swap":
            return [1.0 if plan.groups[0][0] in (4, 5) else 0.05] * n
        return [0.0 if plan.mode == "full_prefill" else
                sum(1.0 for l in (4, 5) if l not in plan.recomputed_layers(8)) + 0.01] * n

    def sender_scores(self) -> list[float]:
        return [0.0] * len(self.rows)

    def __call__(self, plan: ReusePlan) -> float:
        s = self.scores(plan)
        return sum(s) / len(s)


def test_the_profile_with_the_fidelity_search_chooses_the_group_and_the_config_carries_it(tmp_path):
    """End to end over `run`: layers 4 and 5 matter; the fidelity search chooses [4, 6), its test
    interval decides, full reuse's test interval is below the rule, and the JSON says how."""
    train, test = Scorer(120, 5), Scorer(120, 6)
    settings = ProfileSettings(search="fidelity", fidelity=FAST)
    result = run(train, test, 8, settings, pair=Pair("a", "b", "t"))
    assert (result["chosen"]["start"], result["chosen"]["end"]) == (4, 6)
    assert result["chosen"]["test_interval"]["verdict"] == "within" and result["chosen"]["passes_test"] is True
    assert result["full_reuse"]["test_interval"]["verdict"] == "below"
    fid = result["fidelity"]
    assert fid["decided"] and fid["chosen_verdict"] == "within" and fid["race_rows"] <= 120
    assert fid["shortlist"][0] == ReusePlan.recompute(4, 6).label()
    cfg = recompute_config(result, ModelRef(tmp_path / "a", "a", "ci", "a" * 64),
                           ModelRef(tmp_path / "b", "b", "ci", "b" * 64), 1)
    assert cfg.test_verdict == "within" and cfg.chosen.recomputed_layers == 2


def test_the_fidelity_search_needs_per_row_scores():
    from droidmesh.shared.errors import BadRequestError

    with pytest.raises(BadRequestError, match="fidelity search needs"):
        run(lambda plan: 1.0, lambda plan: 1.0, 8, ProfileSettings(search="fidelity"))


def test_the_estimate_bounds_the_rows_the_fidelity_search_scores_and_buys_rows():
    """Row-evaluations the fidelity profile pays for on the train split (task scores and
    divergences, each row once per plan) stay within the announced count; at 64 rows of a
    30-layer pair it is announced at under half the guided search's cost."""
    from droidmesh.shared.profiling import cost

    class Counting(Scorer):
        def __init__(self, n: int, seed: int):
            super().__init__(n, seed)
            self.paid: dict[tuple[str, ReusePlan], int] = {}

        def scores(self, plan, rows=None):
            got = super().scores(plan, rows)
            key = ("score", plan)
            self.paid[key] = max(self.paid.get(key, 0), len(got))
            return got

        def divergences(self, plan, rows=None):
            got = super().divergences(plan, rows)
            key = ("kl", plan)
            self.paid[key] = max(self.paid.get(key, 0), len(got))
            return got

    train, test = Counting(64, 7), Scorer(64, 8)
    run(train, test, 8, ProfileSettings(search="fidelity"))
    announced = cost.row_evaluations(cost.Work("fidelity", False, 64, 64), 8, 2)[1]
    assert sum(train.paid.values()) <= announced
    timing = cost.Timing(1.0, 0.2, 0.3)
    fid = cost.seconds(cost.Work("fidelity", False, 64, 64), 30, 2, timing)
    assert fid < 0.5 * cost.seconds(cost.Work("guided", False, 64, 64), 30, 2, timing)


def test_full_reuse_races_too_and_wins_where_it_holds():
    """Full reuse scoring as full prefill on every row: it is within the rule at the first verdict,
    so no group is recomputed (every larger plan leaves the race)."""

    class Holds(Scorer):
        def scores(self, plan, rows=None):
            if plan.mode == "full_reuse":
                plan = ReusePlan.full_prefill()
            return super().scores(plan, rows)

    result = run(Holds(120, 5), Holds(120, 6), 8, ProfileSettings(search="fidelity", fidelity=FAST))
    assert (result["chosen"]["start"], result["chosen"]["end"]) == (0, 0)
    race = {e["plan"]: e for e in result["fidelity"]["race"]}
    assert race[ReusePlan.full_reuse().label()]["verdict"] == "within"
    assert all(e["dropped"] == "a smaller plan is within the rule" for k, e in race.items()
               if k != ReusePlan.full_reuse().label())


def spread_divergence(asked: set[ReusePlan]):
    """Layers 3..7 each carry a fifth of full reuse's divergence: no 2-layer window removes half."""
    def divergence(plan: ReusePlan, n: int) -> list[float]:
        asked.add(plan)
        if plan.mode == "swap":
            return [1.0 if 3 <= plan.groups[0][0] <= 7 else 0.01] * n
        if plan.mode == "full_reuse":
            return [5.0] * n
        return [sum(1.0 for l in range(3, 8) if l not in plan.recomputed_layers(8))] * n
    return divergence


def test_a_cap_probes_no_larger_group_and_races_the_closest_one_flagged():
    """Under max_layers=2 no window of more than 2 layers is probed; none of 2 removes half of the
    divergence, so the closest is short-listed anyway and flagged with the share it removes.
    Without the cap the short list holds only windows that remove half."""
    asked: set[ReusePlan] = set()
    capped = fidelity.rank(spread_divergence(asked), 8, 2, fidelity.Settings(probe_rows=4, max_layers=2))
    assert all(len(p.recomputed_layers(8)) <= 2 for p in asked if p.mode == "groups")
    assert [(s, e) for s, e, _ in capped.windows] == [(4, 6)]
    assert [p for p, _ in capped.shortlist] == [ReusePlan.recompute(4, 6)]
    assert capped.short_of_share == [(ReusePlan.recompute(4, 6), 3.0)]

    free = fidelity.rank(spread_divergence(set()), 8, 2, fidelity.Settings(probe_rows=4))
    assert free.short_of_share == []
    assert all(kl <= 2.5 for p, _ in free.shortlist for s, e, kl in free.windows if p == ReusePlan.recompute(s, e))


def test_a_capped_profile_says_its_plan_is_short_of_the_divergence_rule():
    """End to end over `run`: the flagged plan is raced on the task metric, the JSON carries its
    share, and the warning names it."""
    from droidmesh.shared.profiling.job import cap_warning

    class Spread(Scorer):
        def divergences(self, plan, rows=None):
            return spread_divergence(set())(plan, len(self.rows) if rows is None else rows)

    settings = ProfileSettings(search="fidelity", fidelity=dataclasses.replace(FAST, max_layers=2))
    result = run(Spread(120, 5), Spread(120, 6), 8, settings)
    fid = result["fidelity"]
    assert [e["plan"] for e in fid["race"]] == [ReusePlan.full_reuse().label(), ReusePlan.recompute(4, 6).label()]
    assert fid["short_of_kl_share"] == [{"plan": ReusePlan.recompute(4, 6).label(), "kl": 3.0,
                                         "share_removed": pytest.approx(0.4)}]
    warning = cap_warning(result)
    assert warning is not None and "<= 2 layers" in warning and "[4,6)" in warning and "40%" in warning
    assert cap_warning(run(Scorer(120, 5), Scorer(120, 6), 8, settings)) is None  # [4, 6) removes it all


@pytest.mark.parametrize(("settings", "match"), [
    (ProfileSettings(search="guided", fidelity=fidelity.Settings(max_layers=6)), "needs the fidelity search"),
    (ProfileSettings(search="fidelity", granularity=4, fidelity=fidelity.Settings(max_layers=2)), "below the granularity"),
])
def test_a_cap_the_search_cannot_keep_is_refused_not_ignored(settings, match):
    from droidmesh.shared.errors import BadRequestError

    with pytest.raises(BadRequestError, match=match):
        run(Scorer(40, 1), Scorer(40, 2), 8, settings)


def test_the_estimate_charges_only_the_windows_a_cap_lets_the_search_probe():
    from droidmesh.shared.profiling import cost

    free = cost.row_evaluations(cost.Work("fidelity", False, 64, 64), 30, 2)[1]
    capped = cost.row_evaluations(cost.Work("fidelity", False, 64, 64, max_layers=6), 30, 2)[1]
    assert free - capped == 8 * (15 - 3)  # probe rows x the sizes 8..30 no longer probed
