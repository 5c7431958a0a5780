"""Offline search on a synthetic quality oracle whose answer is known."""

from __future__ import annotations

import pytest

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling import search
from droidmesh.shared.profiling.datasets import split_rows
from droidmesh.shared.profiling.profile import ProfileSettings, recompute_config, run

L = 8
CRITICAL = {4, 6}  # reusing either loses quality; layer 5 between them is harmless on its own


def oracle(plan: ReusePlan) -> float:
    """1.0 minus 0.3 per critical layer reused, minus 0.02 per extra reuse->recompute transition
    (each injects the sender's E deviation, which is why groups are contiguous)."""
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
    result = run(oracle, oracle, L, ProfileSettings(granularity=2, exhaustive=True))
    assert result["searches_agree"]
    assert (result["chosen"]["start"], result["chosen"]["end"]) == (4, 8)
    assert result["evaluations"]["guided"] < result["evaluations"]["exhaustive"] == 10


def test_contiguous_group_beats_scattered_critical_layers():
    """Recomputing the critical layers alone (two transitions) scores below the group."""
    result = run(oracle, oracle, L, ProfileSettings(granularity=1, exhaustive=False))
    assert result["scattered_critical"]["groups"] == [[4, 5], [6, 7]]
    assert result["scattered_critical"]["quality_train"] < result["chosen"]["quality_train"]


def test_frontier_is_monotone_and_starts_at_full_reuse():
    """The frontier rises with recomputed layers and begins at full reuse (0 layers)."""
    result = run(oracle, oracle, L, ProfileSettings())
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

    result = run(oracle, oracle, L, ProfileSettings(), pair=Pair("a", "b", "t"), others={"same": oracle, "other": needs_layer_2})
    rows = {r["task"]: r for r in result["robustness"]}
    assert list(rows) == ["t", "same", "other"]
    assert rows["same"]["difference"] == 0.0 and rows["same"]["within_tolerance"]
    assert rows["other"]["chosen"] == pytest.approx(0.4) and rows["other"]["difference"] == pytest.approx(-0.4)
    assert rows["other"]["relative"] == pytest.approx(-0.5) and not rows["other"]["within_tolerance"]


def test_chosen_split_keeps_the_layers_but_pays_per_transition():
    """The chosen group split into one-layer groups recomputes the same layers with one E
    transition each, and the oracle charges every extra transition."""
    result = run(oracle, oracle, L, ProfileSettings())
    sp, ch = result["chosen_split"], result["chosen"]
    assert sp["groups"] == [[l, l + 1] for l in range(ch["start"], ch["end"])]
    assert sp["recomputed_layers"] == ch["recomputed_layers"] and sp["e_transitions"] == ch["recomputed_layers"]
    assert sp["quality_train"] == pytest.approx(ch["quality_train"] - 0.02 * (ch["recomputed_layers"] - 1))


def test_recompute_config_carries_the_choice_the_frontier_and_both_hashes(tmp_path):
    """The published config is built from the profile JSON alone (fresh or read back): the
    chosen group and frontier as plans, train qualities, and each model's content hash."""
    result = run(oracle, oracle, L, ProfileSettings(), pair=Pair("s", "r", "t"))
    sender = ModelRef(tmp_path / "s", "s", "ci", "a" * 64)
    receiver = ModelRef(tmp_path / "r", "r", "ci", "b" * 64)
    cfg = recompute_config(result, sender, receiver, version=3)
    assert (cfg.sender_model, cfg.receiver_model, cfg.profile_version, cfg.task) == ("s", "r", 3, "t")
    assert (cfg.sender_sha256, cfg.receiver_sha256) == ("a" * 64, "b" * 64)
    assert cfg.chosen.plan.groups == [(4, 8)] and cfg.chosen.quality == result["chosen"]["quality_train"]
    assert cfg.frontier[0].plan.groups == [] and cfg.frontier[0].recomputed_layers == 0
    assert [p.quality for p in cfg.frontier] == [p["quality"] for p in result["frontier"]]
    assert cfg.full_prefill_quality == 1.0 and cfg.latency is None


def test_split_rows_is_deterministic_disjoint_and_covers_the_file():
    """One file splits the same way every time, half in test, no row in both, none lost."""
    rows = [{"_id": i} for i in range(9)]
    train, test = split_rows(rows, "train"), split_rows(rows, "test")
    assert split_rows(rows, "test") == test and len(test) == 4 and len(train) == 5
    assert sorted(r["_id"] for r in train + test) == list(range(9))
    assert [r["_id"] for r in test] == sorted(r["_id"] for r in test)  # file order kept
    assert len(split_rows(rows[:2], "test")) == 1 and len(split_rows(rows[:2], "train")) == 1
