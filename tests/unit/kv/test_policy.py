"""The reuse policy: which plan a request gets, and why, from config, holder and online state."""

from __future__ import annotations

import pytest

from droidmesh.shared.kv import policy
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.wire.schemas import CacheAvailable, Fingerprint, FrontierPoint, LatencyFit, PlanSpec, RecomputeConfig, RelayBucket

# 12 layers; 1 ms per 1k tokens per layer of compute, nothing else.
FIT = LatencyFit(c0=0.0, c_tok=0.0, c_layer_tok=1e-6, c_attn=0.0, kv_bytes_per_token_layer=1000, e_bytes_per_token=2000)
FRONTIER = [
    FrontierPoint(PlanSpec(groups=[]), 0, 0.50),  # full reuse: below target
    FrontierPoint(PlanSpec(groups=[(2, 4)]), 2, 0.96),  # the chosen: fewest layers within 5% of 1.0
    FrontierPoint(PlanSpec(groups=[(2, 6)]), 4, 0.98),
    FrontierPoint(PlanSpec(groups=[(0, 8)]), 8, 1.00),
]
CFG = RecomputeConfig(sender_model="s", receiver_model="r", sender_sha256="S1", receiver_sha256="R1",
                      profile_version=1, task="qa", tolerance=0.05, chosen=FRONTIER[1], frontier=FRONTIER,
                      full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=12, latency=FIT)
ME = policy.Receiver(model_id="r", model_sha256="R1", num_layers=12)
FP = Fingerprint("llama", 12, 8, 2, 1, 4, "rope", "v")


def holder(e_layers: tuple[int, ...] = (0, 2), sha: str = "S1") -> CacheAvailable:
    return CacheAvailable(sender_id="s-1", model_id="s", model_sha256=sha, fingerprint=FP, fingerprint_id="f",
                          context_id="c", token_ids=[1, 2, 3], dtype="float32", kv_nbytes=[1] * 12,
                          e_layers=list(e_layers), e_nbytes=1, transport="inproc", address="a", published_at=0.0)


def test_queue_picks_fewest_layers_meeting_quality():
    """With requests queued (unlimited bandwidth) the fewest layers above the target win."""
    assert policy.select_point(CFG, queued=3, tokens=4000) == FRONTIER[1]


def test_idle_with_slo_spends_spare_time_on_quality():
    """With no queue, the most recomputation whose estimate meets the SLO is chosen."""
    # 4000 tokens: k layers cost 4 ms each; an 18 ms SLO admits k = 4 but not k = 8.
    assert policy.select_point(CFG, queued=0, tokens=4000, slo_s=0.018) == FRONTIER[2]
    assert policy.select_point(CFG, queued=0, tokens=4000, slo_s=1.0) == FRONTIER[3]


def test_impossible_slo_falls_back_to_fastest():
    """An SLO no point meets yields the fastest eligible point, never one below target."""
    assert policy.select_point(CFG, queued=0, tokens=4000, slo_s=1e-6) == FRONTIER[1]


def test_slow_link_pushes_towards_more_recompute():
    """On a slow link, recomputing more layers pulls fewer bytes and is estimated faster."""
    slow = 10e6  # 10 MB/s
    est = {p.recomputed_layers: policy.estimated_ttft(CFG, p, 4000, slow) for p in FRONTIER[1:]}
    assert est[8] < est[4] < est[2]
    assert policy.select_point(CFG, queued=3, tokens=4000, bandwidth_bps=slow) == FRONTIER[3]


def test_config_plan_is_the_selected_point():
    """A fitting config turns into that point's groups, served as `partial` with its codec."""
    d = policy.decide("auto", holder(), None, CFG, ME, policy.Online(tokens=4000, queued=3))
    assert (d.plan, d.path, d.reason, d.codec) == (ReusePlan.recompute(2, 4), "partial", None, "raw")


def test_forced_modes_win():
    """full_prefill is forced even with a holder; full_reuse needs a holder, else full prefill."""
    assert policy.decide("full_prefill", holder(), None, CFG, ME, policy.Online(10)).reason[0] == "forced"
    assert policy.decide("full_reuse", holder(), None, None, ME, policy.Online(10)).path == "full_reuse"
    miss = ("no_cache", "no cached prefix")
    assert policy.decide("full_reuse", None, miss, None, ME, policy.Online(10)).reason == miss


def test_config_for_other_sender_weights_is_stale():
    """A sender re-trained under the same name does not inherit the pair's config."""
    d = policy.decide("auto", holder(sha="S2"), None, CFG, ME, policy.Online(10))
    assert (d.path, d.reason[0]) == ("full_prefill", "stale_config")


def test_stale_config_falls_back_to_the_default_group():
    """With a stale config, a configured default group still serves the request."""
    me = policy.Receiver(model_id="r", model_sha256="R1", num_layers=12, default_group=(2, 6))
    d = policy.decide("auto", holder(sha="S2"), None, CFG, me, policy.Online(10))
    assert d.plan == ReusePlan.recompute(2, 6)


def test_receiver_accepts_only_configs_of_its_own_weights():
    """A config profiled on other receiver weights or another layer count is not accepted."""
    assert policy.accepts(CFG, ME)
    assert not policy.accepts(CFG, policy.Receiver("r", "R2", 12))
    assert not policy.accepts(CFG, policy.Receiver("r", "R1", 6))


def test_holder_without_the_points_e_is_not_used():
    """Points whose transition E the holder lacks are skipped while another point's E is kept."""
    d = policy.decide("auto", holder(e_layers=(0,)), None, CFG, ME, policy.Online(4000, queued=3))
    assert d.plan == ReusePlan.recompute(0, 8)


def test_groups_extend_down_to_e_the_holder_keeps():
    """A context prefilled before its config keeps no group's E: groups start lower instead of full prefill."""
    only_mid = RecomputeConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__},
                                  "frontier": FRONTIER[1:3], "chosen": FRONTIER[1]})
    d = policy.decide("auto", holder(e_layers=(0,)), None, only_mid, ME, policy.Online(4000, queued=3))
    (s, e), = only_mid.chosen.plan.groups
    assert s > 0 and d.path == "partial" and d.plan == ReusePlan.recompute(0, e)
    two = FrontierPoint(plan=PlanSpec(groups=[(2, 3), (5, 7)]), recomputed_layers=3, quality=0.9)
    assert policy.extended(two, {0, 4}).plan.groups == [(0, 3), (4, 7)]
    assert policy.extended(two, {0}).plan.groups == [(0, 7)]
    merged = policy.extended(FrontierPoint(plan=PlanSpec(groups=[(2, 3), (3, 5)]), recomputed_layers=3, quality=0.9), {0})
    assert merged.plan.groups == [(0, 5)] and merged.recomputed_layers == 5


def test_no_config_no_default_is_full_prefill_with_reason():
    """Without a config or default group the receiver computes itself and says why."""
    d = policy.decide("auto", holder(), None, None, ME, policy.Online(10))
    assert (d.path, d.reason[0]) == ("full_prefill", "no_config")


@pytest.mark.parametrize("plan, path", [(ReusePlan.recompute(1, 2), "partial"), (ReusePlan.full_reuse(), "full_reuse"),
                                        (ReusePlan.cacheblend(0.1), "cacheblend"),
                                        (ReusePlan.full_prefill(), "full_prefill")])
def test_every_serving_plan_has_a_path(plan, path):
    """Each serving mode maps to its reply path; the swap probe is refused, not a KeyError."""
    assert policy.path_of(plan) == path
    with pytest.raises(ValueError, match="probe"):
        policy.path_of(ReusePlan.swap([1]))


def test_published_spec_round_trips():
    """A plan published as a spec comes back as the same plan."""
    plan = ReusePlan.recompute_groups([(0, 2), (4, 6)])
    assert policy.plan_of(policy.spec_of(plan)) == plan


def test_published_spec_with_patch_and_codec_round_trips():
    """Patch layers, codec and its params survive publishing: spec -> plan is the same plan."""
    plan = ReusePlan.recompute(5, 6).patched([4])
    spec = policy.spec_of(plan, "lowrank", {"maps": "a" * 64})
    assert (spec.groups, spec.patch_layers, spec.codec, spec.codec_params) == ([(5, 6)], [4], "lowrank", {"maps": "a" * 64})
    assert policy.plan_of(spec) == plan


def test_estimated_ttft_uses_the_profiled_wire_bytes():
    """A point with wire_bytes_per_token moves exactly those bytes; a raw point (0) the fit's
    per-layer bytes: the same plan coded at 1/10 of the bytes is estimated 10x faster on a slow link."""
    raw = FRONTIER[1]  # [2, 4): E at 2 + 10 reused layers = 12000 bytes per token under FIT
    coded = FrontierPoint(PlanSpec(groups=[(2, 4)], codec="lowrank", codec_params={"maps": "a" * 64}), 2, 0.96,
                          wire_bytes_per_token=1200)
    slow = 1e6  # bytes/s: transfer dominates the 8 ms of compute
    assert policy.estimated_ttft(CFG, raw, 4000, slow, reused=4000) == pytest.approx(4000 * 12000 / slow)
    assert policy.estimated_ttft(CFG, coded, 4000, slow, reused=4000) == pytest.approx(4000 * 1200 / slow)
    assert policy.estimated_ttft(CFG, coded, 4000, None, reused=4000) == pytest.approx(0.008)  # unknown bandwidth: compute only


# -- relay or not (the causal audit's decision): reuse only when it is predicted faster than the receiver's own prefill
CODED = FrontierPoint(PlanSpec(groups=[(2, 4)], codec="lowrank", codec_params={"maps": "a" * 64}), 2, 0.96,
                      wire_bytes_per_token=1200)
CODED_CFG = RecomputeConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__}, "frontier": [*FRONTIER, CODED]})


def test_huge_overlap_on_a_fast_link_reuses():
    """3,990 of 4,000 tokens reusable at 10 GB/s: reuse is predicted several times faster than the
    receiver's own prefill, and both predictions travel with the decision."""
    d = policy.decide("auto", holder(), None, CFG, ME, policy.Online(4000, queued=1, bandwidth_bps=10e9,
                                                                     reused_tokens=3990, reuse_overhead_s=0.001))
    assert d.path == "partial" and d.plan == ReusePlan.recompute(2, 4)
    own = d.predicted_s[policy.PREFILL_OPTION]
    assert own == pytest.approx(0.048) and d.predicted_ttft_s is not None and d.predicted_ttft_s < own / 3
    assert d.predicted_s["recompute [2,4)"] == d.predicted_ttft_s


def test_small_overlap_serves_its_own_prefill_and_says_why():
    """100 of 4,000 tokens reusable: recompute saves ~1 ms, less than reuse's fixed 2 ms: own prefill."""
    d = policy.decide("auto", holder(), None, CFG, ME, policy.Online(4000, queued=1, bandwidth_bps=1e9,
                                                                     reused_tokens=100, reuse_overhead_s=0.002))
    assert d.path == "full_prefill" and d.reason is not None and d.reason[0] == "prefill_faster"
    assert "100 of 4000 tokens reusable" in d.reason[1] and d.predicted_ttft_s == d.predicted_s[policy.PREFILL_OPTION]


def test_slow_link_long_context_takes_the_compressed_option_or_its_own_prefill():
    """At 200 MB/s a 4K context's raw KV (48 MB, 240 ms) loses to the 48 ms own prefill, the
    lowrank point (1/10 the bytes, 24 ms) wins; at 10 MB/s even that is slower: own prefill."""
    mid = policy.decide("auto", holder(), None, CODED_CFG, ME, policy.Online(4000, queued=1, bandwidth_bps=200e6,
                                                                            reused_tokens=3999))
    assert mid.path == "partial" and mid.codec == "lowrank"
    assert mid.predicted_s["recompute [2,4) (lowrank)"] < mid.predicted_s["recompute [2,4)"]
    slow = policy.decide("auto", holder(), None, CODED_CFG, ME, policy.Online(4000, queued=1, bandwidth_bps=10e6,
                                                                             reused_tokens=3999))
    assert slow.path == "full_prefill" and slow.reason is not None and slow.reason[0] == "prefill_faster"


# -- closing the loop: the audit's relay buckets and the online calibration
def _with_relay(*buckets: tuple[float, float, bool | None]) -> RecomputeConfig:
    relay = [RelayBucket(lo, hi, verdict) for lo, hi, verdict in buckets]
    return RecomputeConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__}, "relay": relay})


def test_a_relay_bucket_the_audit_found_slower_sends_the_request_to_its_own_prefill():
    """Reuse predicted faster at a reusable fraction of 0.5, but the audit vetoed [0, 0.7): own
    prefill, reason audit_policy; at 0.999 (bucket [0.95, 1] relay true) the prediction decides."""
    cfg = _with_relay((0.95, 1.0, True), (0.7, 0.95, None), (0.0, 0.7, False))
    half = policy.decide("auto", holder(), None, cfg, ME, policy.Online(4000, queued=1, bandwidth_bps=10e9,
                                                                        reused_tokens=2000))
    assert half.path == "full_prefill" and half.reason is not None and half.reason[0] == "audit_policy"
    assert half.weighed and half.predicted_ttft_s == half.predicted_s[policy.PREFILL_OPTION]
    top = policy.decide("auto", holder(), None, cfg, ME, policy.Online(4000, queued=1, bandwidth_bps=10e9,
                                                                       reused_tokens=4000))
    assert top.path == "partial" and top.weighed


def test_calibration_scales_predictions_and_can_flip_the_choice():
    """Reuse measured 4x slower than fitted (own prefill as fitted): at 2,000 of 4,000 tokens
    reusable the scaled reuse loses to own prefill; raw predictions are kept beside the scaled."""
    cal = policy.Calibration(min_samples=3)
    assert cal.scale("reuse:s") == 1.0
    for _ in range(3):
        cal.observe("reuse:s", 0.01, 0.04)
        cal.observe(policy.PREFILL_KIND, 0.05, 0.05)
    online = policy.Online(4000, queued=1, bandwidth_bps=10e9, reused_tokens=2000,
                           reuse_scale=cal.scale("reuse:s"), prefill_scale=cal.scale(policy.PREFILL_KIND))
    assert (online.reuse_scale, online.prefill_scale) == (4.0, 1.0)
    raw = policy.decide("auto", holder(), None, CFG, ME, policy.Online(4000, queued=1, bandwidth_bps=10e9,
                                                                       reused_tokens=2000))
    scaled = policy.decide("auto", holder(), None, CFG, ME, online)
    assert raw.path == "partial" and scaled.path == "full_prefill" and scaled.reason[0] == "prefill_faster"
    assert scaled.raw_s == raw.predicted_s
    assert scaled.predicted_s["recompute [2,4)"] == pytest.approx(4 * raw.predicted_s["recompute [2,4)"])


def test_calibration_is_robust_bounded_and_ignores_nonsense():
    """The scale is a median (one outlier does not move it), clamped, and non-positive or
    infinite samples are ignored; kinds beyond the bound forget the least recent."""
    cal = policy.Calibration(window=5, min_samples=3, clamp=8.0, max_kinds=2)
    for r in (2.0, 2.0, 2.0, 1000.0):
        cal.observe("a", 1.0, r)
    assert cal.scale("a") == 2.0
    for _ in range(3):
        cal.observe("b", 1.0, 1e6)
        cal.observe("b", 0.0, 1.0)
        cal.observe("b", 1.0, float("inf"))
    assert cal.scale("b") == 8.0
    cal.observe("c", 1.0, 1.0)
    assert cal.scale("a") == 1.0  # forgotten: "b" and "c" were seen since


def test_only_requests_where_relaying_was_weighed_are_in_the_experiment():
    """A holder with a config (either choice) or a default group is weighed; a miss or a forced mode is not."""
    assert policy.decide("auto", holder(), None, CFG, ME, policy.Online(4000, reused_tokens=3990)).weighed
    assert policy.decide("auto", holder(), None, CFG, ME, policy.Online(4000, reused_tokens=10)).weighed
    assert not policy.decide("auto", None, ("no_cache", "x"), CFG, ME, policy.Online(4000)).weighed
    assert not policy.decide("full_prefill", holder(), None, CFG, ME, policy.Online(4000)).weighed
    mine = policy.Receiver(model_id="r", model_sha256="R1", num_layers=12, default_group=(2, 4))
    assert policy.decide("auto", holder(), None, None, mine, policy.Online(4000)).weighed


def _own(sender_id: str = "r-2") -> CacheAvailable:
    """A holder running the receiver's own weights (another agent on the same model)."""
    h = holder(sha="R1")
    return CacheAvailable(**{**{f: getattr(h, f) for f in h.__struct_fields__}, "sender_id": sender_id, "model_id": "r"})


def test_a_holder_with_the_receivers_own_weights_is_fully_reused_without_a_profile():
    """Own weights need no pair config: full reuse (exact), weighed when no fit is known."""
    cfg = policy.config_for(_own(), ME, {})
    d = policy.decide("auto", _own(), None, cfg, ME, policy.Online(tokens=4000, queued=3))
    assert (d.plan, d.path, d.reason, d.weighed) == (ReusePlan.full_reuse(), "full_reuse", None, True)
    assert policy.config_for(holder(), ME, {"s": CFG}) is CFG  # other weights: the pair's own config


def test_own_weights_borrow_the_receivers_fit_and_buckets_and_still_weigh_the_link():
    """With a fit from the receiver's configs, own-weights reuse wins on a fast link, loses on a slow one."""
    vetoed = RelayBucket(0.0, 0.7, False)
    cfg = policy.config_for(_own(), ME, {"s": RecomputeConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__},
                                                                  "relay": [vetoed]})})
    assert (cfg.latency, cfg.relay, cfg.frontier[0].quality) == (FIT, [vetoed], 1.0)
    fast = policy.decide("auto", _own(), None, cfg, ME, policy.Online(tokens=4000, reused_tokens=3990))
    assert fast.path == "full_reuse" and fast.predicted_s["full reuse"] < fast.predicted_s[policy.PREFILL_OPTION]
    slow = policy.decide("auto", _own(), None, cfg, ME, policy.Online(tokens=4000, reused_tokens=3990,
                                                                        bandwidth_bps=1e6))
    assert (slow.path, slow.reason[0]) == ("full_prefill", "prefill_faster")
    small = policy.decide("auto", _own(), None, cfg, ME, policy.Online(tokens=4000, reused_tokens=1000))
    assert (small.path, small.reason[0]) == ("full_prefill", "audit_policy")


def test_the_expected_queue_wait_is_added_to_every_option():
    """With requests ahead, each option's prediction carries the wait for the compute thread; the choice holds."""
    quiet = policy.decide("auto", holder(), None, CFG, ME, policy.Online(tokens=4000, reused_tokens=3990))
    busy = policy.decide("auto", holder(), None, CFG, ME, policy.Online(tokens=4000, reused_tokens=3990,
                                                                        queue_wait_s=0.5))
    assert busy.plan == quiet.plan and set(busy.predicted_s) == set(quiet.predicted_s)
    assert all(busy.predicted_s[k] == pytest.approx(quiet.predicted_s[k] + 0.5) for k in quiet.predicted_s)
    assert busy.raw_s == quiet.raw_s  # calibration learns compute only


def test_queue_wait_is_the_requests_ahead_times_the_recent_median_hold():
    """No estimate before min_samples or with nobody ahead; then queued x median, robust to one outlier."""
    q = policy.QueueWait(window=8, min_samples=3)
    q.observe(0.1)
    q.observe(0.1)
    assert q.wait(2) == 0.0
    q.observe(9.0)
    q.observe(0.1)
    q.observe(float("nan"))  # ignored
    assert q.wait(0) == 0.0 and q.wait(3) == pytest.approx(0.3)


@pytest.mark.parametrize("sha", ["S1", "R1"], ids=["other weights", "the receiver's own weights"])
def test_a_holder_sharing_only_the_opening_is_not_reused(sha):
    """A holder covering 3 of 40 prompt tokens (a shared chat opening) under min_reuse_fraction 0.5:
    full prefill with the short-prefix reason, for a holder of other weights and of the receiver's
    own weights alike (a reply must not call 3 tokens a full reuse); at half the prompt it is used."""
    me = policy.Receiver(model_id="r", model_sha256="R1", num_layers=12, min_reuse_fraction=0.5)
    h = holder(sha=sha)
    cfg = policy.config_for(h, me, {"s": CFG})
    d = policy.decide("auto", h, None, cfg, me, policy.Online(tokens=40, queued=3, reused_tokens=3))
    assert (d.path, d.reason[0] if d.reason else None) == ("full_prefill", "short_prefix")
    d = policy.decide("auto", h, None, cfg, me, policy.Online(tokens=40, queued=3, reused_tokens=20))
    assert d.path != "full_prefill"


def test_a_new_holder_is_predicted_at_its_links_rate_then_at_its_own():
    """Pulls from a host 10x slower than this one's shm: a new sender there is predicted at that
    host's rate, not at the average over every holder, which shm's pulls dominate."""
    rates = policy.PullRates()
    assert rates.of("a", "shm") is None  # nothing measured: no link term in the prediction
    for _ in range(20):
        rates.observe("a", "shm", 10_000_000, 0.001)  # 10 GB/s, this host
    rates.observe("b", "ucx 10.0.0.7", 1_000_000, 0.001)  # 1 GB/s, another host
    assert rates.of("c", "ucx 10.0.0.7") == pytest.approx(1e9)  # new, on b's host
    assert rates.of("d", "ucx 10.0.0.9") == pytest.approx(rates.overall)  # new, on a host never measured
    assert rates.overall > 5e9
    rates.observe("c", "ucx 10.0.0.7", 3_000_000, 0.001)
    assert rates.of("c", "ucx 10.0.0.7") == pytest.approx(3e9)  # its own first pull
    assert rates.of("e", "ucx 10.0.0.7") == pytest.approx(0.8 * 1e9 + 0.2 * 3e9)  # the link's average moved


def test_pull_rates_ignore_empty_pulls_and_stay_bounded():
    rates = policy.PullRates(keep=3)
    rates.observe("a", "shm", 0, 0.001)
    rates.observe("a", "shm", 1000, 0.0)
    assert rates.overall is None and rates.of("a", "shm") is None
    for i in range(10):
        rates.observe(f"h{i}", f"ucx 10.0.0.{i}", 1000 * (i + 1), 1.0)
    assert rates.of("h9", "x") == pytest.approx(10_000)  # the most recent are kept
    assert rates.of("h0", "ucx 10.0.0.0") == rates.overall  # the oldest holder and link are gone
