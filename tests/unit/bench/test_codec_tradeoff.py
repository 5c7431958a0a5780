"""`bench codecs`' pure pieces: the Pareto front, the chosen-config rule, the targets (no models, no mesh)."""

from __future__ import annotations

import pytest

from droidmesh.shared.tools.bench import codec_tradeoff as bc


def _row(config, family, ttft, quality, bytes_per_token, *, pair="base->qa", link=0.25, tokens=4096, enc=0.0, dec=0.0):
    return {"pair": pair, "link_gbit": link, "target_tokens": tokens, "tokens": tokens, "config": config,
            "family": family, "ttft_s": ttft, "quality": quality, "bytes_on_wire": bytes_per_token,
            "bytes_total": None if bytes_per_token is None else bytes_per_token * tokens, "encode_s": enc, "decode_s": dec}


ROWS = [
    _row("full prefill", "full prefill", 1.2, 0.90, 0),
    _row("full reuse raw", "full reuse", 0.9, 0.30, 6144),
    _row("raw [4,6)", "raw", 0.8, 0.90, 5376),
    _row("lowrank s0.8 [4,6)", "lowrank", 0.2, 0.70, 600),
    _row("lowrank s0.9 [4,6)", "lowrank", 0.25, 0.88, 928, enc=0.01, dec=0.02),
    _row("lowrank s0.99 [4,6)", "lowrank", 0.3, 0.90, 1500),
    _row("lowrank s0.95 patch 4,5 p0.999", "lowrank patch", 0.1, 0.40, 400),
]


def test_pareto_front_keeps_only_undominated_points_by_ascending_ttft():
    """A point slower and no better than another is off the front; Nones are ignored."""
    pts = [(1.0, 0.9), (0.5, 0.5), (0.6, 0.4), (2.0, 0.9), (0.2, 0.1), (None, 1.0), (0.3, None)]
    assert bc.pareto_front(pts) == [4, 1, 0]


def test_pareto_front_keeps_one_of_equal_points_out_only_when_strictly_dominated():
    """Two identical points dominate neither: both stay."""
    assert bc.pareto_front([(1.0, 0.5), (1.0, 0.5)]) == [0, 1]


def test_choose_takes_the_fastest_lowrank_within_tolerance():
    """Raw configs and lowrank configs below 95% of full prefill's quality are never chosen."""
    assert bc.choose(ROWS, 0.90)["config"] == "lowrank s0.9 [4,6)"  # 0.88 >= 0.855; s0.8 and patch are below
    assert bc.choose(ROWS, 0.90, tolerance=0.0)["config"] == "lowrank s0.99 [4,6)"
    assert bc.choose(ROWS[:3], 0.90) is None


def test_choose_skips_unmeasured_ttft_and_breaks_ties_on_bytes():
    """A config whose TTFT failed over the mesh is not chosen; equal TTFTs go to fewer bytes."""
    rows = [_row("a", "lowrank", None, 0.9, 100), _row("b", "lowrank", 0.3, 0.9, 900), _row("c", "lowrank", 0.3, 0.9, 800)]
    assert bc.choose(rows, 0.9)["config"] == "c"


def test_targets_ratios_against_full_prefill_raw_group_and_raw_all_layers():
    """The target figures for the chosen config, and the encode+decode share of the saved transfer at 1 Gbit/s."""
    other = [_row("full prefill", "full prefill", 9.0, 0.1, 0, link=1.0), _row("x", "lowrank", 0.01, 0.9, 1, pair="summ->qa")]
    t = bc.targets(ROWS + other, "base->qa", 0.25, 4096)
    assert t["chosen"] == "lowrank s0.9 [4,6)"
    assert t["scd_speedup_vs_full_prefill"] == pytest.approx(1.2 / 0.25)
    assert t["scd_speedup_vs_raw_group"] == pytest.approx(0.8 / 0.25)
    assert t["scd_quality_ratio"] == pytest.approx(0.88 / 0.90)
    assert t["scd_bytes_ratio"] == pytest.approx(928 / 6144)
    saved = (5376 - 928) * 4096 * 8 / 1e9
    assert t["encode_decode_share_of_saved_transfer_1gbit"] == pytest.approx(0.03 / saved)
    assert t["rule"] == bc.CHOSEN_RULE


def test_targets_without_a_qualifying_config_say_why():
    """No lowrank config within tolerance: every figure is None and the reason is given."""
    t = bc.targets(ROWS[:3], "base->qa", 0.25, 4096)
    assert t["chosen"] is None and t["scd_speedup_vs_full_prefill"] is None and t["why_none"]


def test_configs_baselines_first_then_every_family_of_the_transfer_candidates():
    """Full prefill and full reuse lead; raw, int8, int4, lowrank and patch configs follow for the group."""
    from droidmesh.shared.kv.plan import ReusePlan

    cs = bc.configs(ReusePlan.recompute(4, 6), 12)
    assert [c.family for c in cs[:2]] == ["full prefill", "full reuse"]
    assert {c.family for c in cs} == set(bc.FAMILIES)
    assert all(c.plan.patch for c in cs if c.family == "lowrank patch")
    assert len({c.name for c in cs}) == len(cs)


def test_probe_plans_round_trip_through_their_dict_form():
    """The probe rebuilds each plan, patch layers included, from `ReusePlan.to_dict`."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.tools.bench.probe import plan_from_dict

    for plan in (ReusePlan.full_prefill(), ReusePlan.full_reuse().patched([4, 5]),
                 ReusePlan.recompute(5, 6).patched([4]), ReusePlan.recompute_groups([(0, 2), (4, 6)])):
        assert plan_from_dict(plan.to_dict()) == plan
