"""Offline search on a synthetic quality oracle whose answer is known."""

from __future__ import annotations

import pytest

from shared.kv.plan import ReusePlan
from shared.profiling import search
from shared.profiling.profile import ProfileSettings, run

L = 8
CRITICAL = {4, 6}  # reusing either loses quality; layer 5 between them is harmless on its own


def oracle(plan: ReusePlan) -> float:
    """1.0 minus 0.3 per critical layer reused, minus 0.02 per extra reuse->recompute transition
    (each injects the sender's E deviation, as DroidSpeak §4.1 describes)."""
    if plan.mode == "full_prefill":
        return 1.0
    recomputed = set(plan.recomputed_layers(L))
    q = 1.0 - 0.3 * len(CRITICAL - recomputed) - 0.02 * max(0, len(plan.groups) - 1)
    return max(q, 0.0)


def test_sensitivity_finds_the_critical_layers():
    """Reusing only a critical layer drops quality; those layers are reported critical."""
    sens = search.sensitivity(oracle, L)
    assert search.critical_layers(sens, 1.0, 0.05) == sorted(CRITICAL)


def test_exhaustive_and_guided_agree_and_guided_is_cheaper():
    """Both searches choose the same contiguous group; guided evaluates O(L/g) plans."""
    result, cfg = run(oracle, oracle, L, ProfileSettings(granularity=2))
    assert result["searches_agree"]
    assert (result["chosen"]["start"], result["chosen"]["end"]) == (4, 8)
    assert result["evaluations"]["guided"] < result["evaluations"]["exhaustive"] == 10
    assert cfg.chosen.start == 4 and cfg.chosen.end == 8


def test_contiguous_group_beats_scattered_critical_layers():
    """Recomputing the critical layers alone (two transitions) scores below the group."""
    result, _ = run(oracle, oracle, L, ProfileSettings(granularity=1, exhaustive=False))
    assert result["scattered_critical"]["groups"] == [[4, 5], [6, 7]]
    assert result["scattered_critical"]["quality_train"] < result["chosen"]["quality_train"]


def test_frontier_is_monotone_and_starts_at_full_reuse():
    """The frontier rises with recomputed layers and begins at full reuse (0 layers)."""
    result, _ = run(oracle, oracle, L, ProfileSettings())
    front = result["frontier"]
    assert front[0]["recomputed_layers"] == 0
    qs = [p["quality"] for p in front]
    assert qs == sorted(qs) and len(set(qs)) == len(qs)


def test_robustness_reports_the_chosen_configs_difference_per_task():
    """The config chosen on the train oracle is applied unchanged to other tasks: a task that
    also needs layer 2 recomputed shows the loss, one with the same critical layers shows none."""

    def needs_layer_2(plan: ReusePlan) -> float:
        if plan.mode == "full_prefill":
            return 0.8
        return oracle(plan) * 0.8 - (0.4 if 2 not in plan.recomputed_layers(L) else 0.0)

    result, _ = run(oracle, oracle, L, ProfileSettings(), task="t", others={"same": oracle, "other": needs_layer_2})
    rows = {r["task"]: r for r in result["robustness"]}
    assert list(rows) == ["t", "same", "other"]
    assert rows["same"]["difference"] == 0.0 and rows["same"]["within_tolerance"]
    assert rows["other"]["chosen"] == pytest.approx(0.4) and rows["other"]["difference"] == pytest.approx(-0.4)
    assert rows["other"]["relative"] == pytest.approx(-0.5) and not rows["other"]["within_tolerance"]


def test_chosen_split_keeps_the_layers_but_pays_per_transition():
    """The chosen group split into one-layer groups recomputes the same layers with one E
    transition each, and the oracle charges every extra transition."""
    result, _ = run(oracle, oracle, L, ProfileSettings())
    sp, ch = result["chosen_split"], result["chosen"]
    assert sp["groups"] == [[l, l + 1] for l in range(ch["start"], ch["end"])]
    assert sp["recomputed_layers"] == ch["recomputed_layers"] and sp["e_transitions"] == ch["recomputed_layers"]
    assert sp["quality_train"] == pytest.approx(ch["quality_train"] - 0.02 * (ch["recomputed_layers"] - 1))
