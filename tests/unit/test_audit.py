"""The causal audit of KV relay on synthetic receiver logs whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from droidmesh.shared.audit import estimate, relay, render
from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.wire.schemas import FrontierPoint, PlanSpec, RecomputeConfig, RelayBucket

N_BOOT = 400
_POINT = FrontierPoint(PlanSpec(groups=[(2, 4)]), 2, 0.9)
TINY_CFG = RecomputeConfig(sender_model="s", receiver_model="r", sender_sha256="a" * 64, receiver_sha256="b" * 64,
                           profile_version=1, task="qa", tolerance=0.05, chosen=_POINT, frontier=[_POINT],
                           full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6)


def request(i: int, assignment: str, ttft_ms: float, **over) -> dict:
    """One receiver request line (structlog JSON) with sensible defaults."""
    rec = {"event": "request", "service": "receiver", "level": "info", "timestamp": "2025-11-30T05:00:00Z",
           "request_id": f"{assignment[0]}{i}", "path": "partial" if assignment == "treatment" else "full_prefill",
           "assignment": assignment, "holdout_share": 0.2, "ttft_ms": ttft_ms, "predicted_ttft_ms": None,
           "reusable_fraction": 0.98, "prompt_tokens": 2000, "sender_model": "base", "receiver_model": "qa",
           "queued": 0, "topology": "same_host", "bytes_pulled": 1000 if assignment == "treatment" else 0,
           "stages_ms": {"first_token": ttft_ms, "done": ttft_ms + 100.0}}
    rec.update(over)
    return rec


def arms(n_t: int, t_ms: float, n_c: int, c_ms: float, jitter: float = 10.0, **over) -> list[dict]:
    """`n_t` treatment lines around `t_ms` and `n_c` control lines around `c_ms` (± `jitter` ms)."""
    tag = "".join(f"{k}{v}" for k, v in sorted(over.items()))
    out = [request(i, "treatment", t_ms + jitter * ((i % 5) - 2) / 2, **over) for i in range(n_t)]
    out += [request(i, "control", c_ms + jitter * ((i % 5) - 2) / 2, **over) for i in range(n_c)]
    for r in out:
        r["request_id"] += tag
    return out


def write(tmp_path: Path, records: list, name: str = "receiver.log") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return tmp_path


def run(tmp_path: Path, records: list, **kw) -> dict:
    return estimate.run_audit(write(tmp_path, records), n_boot=kw.pop("n_boot", N_BOOT), **kw)


def row(result: dict, name: str) -> dict:
    return next(r for r in result["strata"] if r["stratum"] == name)


def test_known_effect_in_the_top_stratum(tmp_path):
    """Treatment 0.1 s vs control 0.4 s at reusable >= 0.95: ATE -0.3 s, a CI excluding 0."""
    res = run(tmp_path, arms(30, 100.0, 20, 400.0))
    top = row(res, "reusable=[0.95,1]")
    assert top["ate_ttft_s"] == pytest.approx(-0.3, abs=1e-9)
    assert top["ci_low"] < -0.3 < top["ci_high"] < 0
    assert (top["treatment"], top["control"], top["requests"]) == (30, 20, 50)
    assert top["policy_p50_ttft_s"] == pytest.approx(0.1) and top["full_prefill_p50_ttft_s"] == pytest.approx(0.4)
    assert res["overall"]["ate_ttft_s"] == pytest.approx(-0.3)
    eff = res["overall"]["effects"]
    assert eff["e2e_s"]["ate"] == pytest.approx(-0.3) and eff["bytes"]["ate"] == pytest.approx(1000)
    assert eff["agreement"]["ate"] is None  # no shadow lines


def test_stratum_without_control_gets_nulls(tmp_path):
    """A stratum with treatment only has null effect and interval, its policy p50 still shown."""
    res = run(tmp_path, arms(10, 100.0, 10, 400.0) + arms(5, 200.0, 0, 0.0, reusable_fraction=0.5))
    low = row(res, "reusable=<0.7")
    assert (low["treatment"], low["control"]) == (5, 0)
    assert low["ate_ttft_s"] is None and low["ci_low"] is None and low["ci_high"] is None
    assert low["full_prefill_p50_ttft_s"] is None and low["policy_p50_ttft_s"] == pytest.approx(0.2)
    empty = row(res, "reusable=[0.7,0.85)")
    assert empty["requests"] == 0 and empty["ate_ttft_s"] is None and empty["policy_p50_ttft_s"] is None


def test_one_value_arm_has_no_interval(tmp_path):
    """An arm of one request gives a point estimate but no bootstrap interval."""
    top = row(run(tmp_path, arms(10, 100.0, 1, 400.0, jitter=0.0)), "reusable=[0.95,1]")
    assert top["ate_ttft_s"] == pytest.approx(-0.3) and top["ci_low"] is None and top["ci_high"] is None


def test_garbage_and_other_lines_are_ignored(tmp_path):
    """Non-JSON, truncated JSON, other events, ineligible and TTFT-less lines do not count."""
    junk = ["plain text", "{not json", "[1, 2]", json.dumps({"event": "config_loaded"}),
            json.dumps(request(99, "ineligible", 5.0)),
            json.dumps({**request(98, "treatment", 5.0), "ttft_ms": None}),
            json.dumps({**request(97, "control", 5.0), "ttft_ms": "fast"}),
            "receiver-1  | " + json.dumps(request(0, "control", 400.0, request_id="prefixed"))]
    res = run(tmp_path, [*arms(5, 100.0, 5, 400.0, jitter=0.0), *junk])
    assert res["requests_used"] == 11 and res["lines_read"] == 18
    assert (res["other_request_lines"], res["malformed_request_lines"]) == (1, 2)
    assert res["overall"]["control"] == 6


def test_files_are_found_recursively_and_duplicates_count_once(tmp_path):
    """*.log, *.jsonl and *.txt under subdirectories are read; other suffixes not; a repeated id counts once."""
    lines = arms(4, 100.0, 4, 400.0)
    write(tmp_path, lines[:4], "a/r1.log")
    write(tmp_path, lines[4:], "b/c/r2.jsonl")
    write(tmp_path, lines[:2], "copy.txt")
    write(tmp_path, arms(50, 1.0, 50, 1.0, request_id="z"), "ignored.json")
    res = estimate.run_audit(tmp_path, n_boot=50)
    assert res["files"] == 3 and res["requests_used"] == 8 and res["duplicate_request_lines"] == 2


def test_shadow_agreement_joins_by_request_id(tmp_path):
    """Shadow lines give the treatment's mean agreement per stratum and an effect against 1."""
    lines = arms(4, 100.0, 4, 400.0)
    shadows = [{"event": "shadow", "request_id": "t0", "agreement": 0.8},
               {"event": "shadow", "request_id": "t1", "agreement": 1.0},
               {"event": "shadow", "request_id": "unknown", "agreement": 0.0}]
    res = run(tmp_path, lines + shadows)
    assert row(res, "reusable=[0.95,1]")["quality_agreement"] == pytest.approx(0.9)
    assert res["overall"]["effects"]["agreement"]["ate"] == pytest.approx(-0.1)
    assert row(res, "context=<1K")["quality_agreement"] is None


def test_strata_dimensions(tmp_path):
    """Context, pair, topology and load buckets place each request where its fields say."""
    lines = [request(0, "treatment", 10, prompt_tokens=500, queued=0, topology="remote"),
             request(1, "treatment", 10, prompt_tokens=1024, queued=3, sender_model="summ"),
             request(2, "control", 10, prompt_tokens=4096, queued=4, topology=None),
             request(3, "control", 10, prompt_tokens=4095, queued=1, reusable_fraction=0.85)]
    res = run(tmp_path, lines)
    counts = {r["stratum"]: r["requests"] for r in res["strata"]}
    assert counts == {"reusable=[0.95,1]": 3, "reusable=[0.85,0.95)": 1, "reusable=[0.7,0.85)": 0, "reusable=<0.7": 0,
                      "context=<1K": 1, "context=[1K,4K)": 2, "context=>=4K": 1,
                      "pair=base->qa": 3, "pair=summ->qa": 1,
                      "topology=remote": 1, "topology=same_host": 2,
                      "load=0": 1, "load=1-3": 2, "load=>=4": 1}


def test_summary_figures_on_hand_made_cases(tmp_path):
    """worst_stratum_ratio, top_stratum_speedup and prediction_error (of the served option, both
    arms) on known medians."""
    top = arms(5, 100.0, 5, 400.0, jitter=0.0)  # speedup 4, error 0.1
    slow = arms(5, 300.0, 5, 200.0, jitter=0.0, reusable_fraction=0.5, topology="remote")  # ratio 1.5, error 0.5
    for r in top:
        r["predicted_ttft_ms"] = r["ttft_ms"] * 1.1
    for r in slow:
        r["predicted_ttft_ms"] = r["ttft_ms"] * 0.5
    res = run(tmp_path, top + slow)
    assert res["top_stratum_speedup"] == pytest.approx(4.0)
    assert res["worst_stratum_ratio"] == pytest.approx(1.5) and res["worst_stratum"] in ("reusable=<0.7", "topology=remote")
    assert res["prediction_error"] == pytest.approx(0.3)  # ten at 0.1, ten at 0.5
    none = run(tmp_path / "n", arms(3, 100.0, 0, 0.0))
    assert none["top_stratum_speedup"] is None and none["worst_stratum_ratio"] is None and none["prediction_error"] is None


def test_policy_file_relay_decisions(tmp_path):
    """Relay where the CI is below 0, not where above, null when it spans 0 or an arm is thin."""
    lines = (arms(20, 100.0, 20, 400.0)  # [0.95,1]: faster
             + arms(20, 150.0, 20, 300.0, reusable_fraction=0.9)  # [0.85,0.95): faster
             + arms(20, 200.0, 20, 200.0, jitter=40.0, reusable_fraction=0.8)  # [0.7,0.85): no difference
             + arms(20, 500.0, 20, 200.0, reusable_fraction=0.3))  # <0.7: slower
    res = run(tmp_path, lines)
    pol = relay.policy_proposal(res)
    assert pol["schema"] == relay.POLICY_SCHEMA
    assert [(b["label"], b["relay"]) for b in pol["buckets"]] == [
        ("[0.95,1]", True), ("[0.85,0.95)", True), ("[0.7,0.85)", None), ("<0.7", False)]
    assert pol["min_reusable_fraction"] == 0.85
    assert pol["buckets"][0]["reusable_fraction"] == [0.95, 1.0] and pol["buckets"][3]["reusable_fraction"] == [0.0, 0.7]
    thin = relay.policy_proposal(run(tmp_path / "thin", arms(20, 100.0, 3, 400.0)))
    assert thin["buckets"][0]["relay"] is None and thin["min_reusable_fraction"] is None


def test_the_blind_arm_measures_relaying_where_the_policy_does_not_relay(tmp_path):
    """Below 0.7 the policy serves its own prefill (treatment = control); blind relay there is 150 ms
    slower: the proposal vetoes the bucket on the blind evidence, and blind relay's worst stratum is reported."""
    low = arms(20, 200.0, 20, 200.0, reusable_fraction=0.3)
    blind = [request(i, "blind", 350.0 + (i % 5), reusable_fraction=0.3) for i in range(20)]
    res = run(tmp_path, low + blind + arms(20, 100.0, 20, 400.0))
    row_low = row(res, "reusable=<0.7")
    assert row_low["blind"] == 20 and row_low["blind_ci_low"] > 0.1 and row_low["blind_p50_ttft_s"] == pytest.approx(0.352)
    assert res["blind_worst_stratum_ratio"] == pytest.approx(0.352 / 0.2) and res["worst_stratum_ratio"] < 1.1
    low_bucket = relay.policy_proposal(res)["buckets"][3]
    assert (low_bucket["relay"], low_bucket["evidence"], low_bucket["treatment"]) == (False, "blind", 20)
    top_bucket = relay.policy_proposal(res)["buckets"][0]
    assert (top_bucket["relay"], top_bucket["evidence"]) == (True, "treatment")


def test_decision_overhead_p99_is_the_nearest_rank(tmp_path):
    """100 requests deciding in 0.01..1.00 ms: p99 is 0.99 ms; lines without the field do not count."""
    lines = arms(50, 100.0, 50, 400.0)
    for k, r in enumerate(lines):
        r["decision_ms"] = (k + 1) / 100
    res = run(tmp_path, [*lines, request(999, "control", 1.0)])
    assert res["decision_p99_s"] == pytest.approx(0.99e-3)
    assert run(tmp_path / "none", arms(3, 1.0, 3, 1.0))["decision_p99_s"] is None


def test_a_policy_file_becomes_relay_buckets_and_a_veto_outlives_an_undecided_audit():
    """The proposal's buckets load as RelayBuckets; applied to a config that already vetoes
    [0, 0.7), an undecided (null) verdict there keeps the veto, a decided one replaces it."""
    pol = {"schema": relay.POLICY_SCHEMA, "buckets": [{"reusable_fraction": [0.95, 1.0], "relay": True},
                                                  {"reusable_fraction": [0.0, 0.7], "relay": None}]}
    buckets = relay.relay_buckets(pol)
    assert buckets == [RelayBucket(0.95, 1.0, True), RelayBucket(0.0, 0.7, None)]
    cfg = msgspec.structs.replace(TINY_CFG, relay=[RelayBucket(0.0, 0.7, False)])
    kept = relay.with_relay(cfg, buckets, 7)
    assert kept.profile_version == 7 and kept.relay == [RelayBucket(0.95, 1.0, True), RelayBucket(0.0, 0.7, False)]
    lifted = relay.with_relay(cfg, [RelayBucket(0.0, 0.7, True)], 8)
    assert lifted.relay == [RelayBucket(0.0, 0.7, True)]


@pytest.mark.parametrize("policy, match", [
    ({"schema": "other", "buckets": []}, "not a relay policy"),
    ({"schema": relay.POLICY_SCHEMA, "buckets": []}, "1 to 16"),
    ({"schema": relay.POLICY_SCHEMA, "buckets": [{"reusable_fraction": [0.7, 0.2], "relay": False}]}, "bucket 0"),
    ({"schema": relay.POLICY_SCHEMA, "buckets": [{"reusable_fraction": [0.0, 0.5], "relay": "no"}]}, "bucket 0"),
    ({"schema": relay.POLICY_SCHEMA, "buckets": [{"reusable_fraction": [0, 1]}] * 17}, "1 to 16"),
    ([1, 2], "not a relay policy"),
])
def test_a_malformed_policy_file_is_refused(policy, match):
    """Wrong schema, empty or too many buckets, inverted ranges and non-boolean verdicts are bad requests."""
    with pytest.raises(BadRequestError, match=match):
        relay.relay_buckets(policy)


def test_bootstrap_is_seeded(tmp_path):
    """The same seed gives the same intervals; another seed different ones."""
    d = write(tmp_path, arms(15, 100.0, 15, 300.0, jitter=50.0))
    a, b, c = (estimate.run_audit(d, n_boot=200, seed=s) for s in (1, 1, 2))
    assert row(a, "reusable=[0.95,1]")["ci_low"] == row(b, "reusable=[0.95,1]")["ci_low"]
    assert row(a, "reusable=[0.95,1]")["ci_low"] != row(c, "reusable=[0.95,1]")["ci_low"]
    assert a["overall"]["ci_low"] == a["overall"]["effects"]["ttft_s"]["ci_low"]


@pytest.mark.parametrize("setup,match", [
    (lambda d: d / "missing", "no such directory"),
    (lambda d: d, "no .*files"),
    (lambda d: write(d, ["noise", json.dumps(request(0, "ineligible", 1.0))]), "no usable request lines"),
])
def test_unusable_input_is_a_bad_request(tmp_path, setup, match):
    """A missing directory, no log files, or no treatment/control lines: BadRequestError."""
    with pytest.raises(BadRequestError, match=match):
        estimate.run_audit(setup(tmp_path))


def test_report_and_plot(tmp_path):
    """The printed table lists overall and every stratum; the plot is a PNG."""
    res = run(tmp_path, arms(10, 100.0, 10, 400.0) + arms(3, 100.0, 0, 0.0, reusable_fraction=0.5))
    text = render.format_report(res)
    assert text.splitlines()[0].split()[:2] == ["stratum", "requests"]
    assert all(r["stratum"] in text for r in res["strata"]) and "overall" in text
    render.plot_png(res, tmp_path / "out" / "audit.png")
    assert (tmp_path / "out" / "audit.png").read_bytes()[:4] == b"\x89PNG"
