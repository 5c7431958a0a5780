"""Online selection: the documented rule picks the documented frontier point."""

from __future__ import annotations

from shared.profiling.select import estimated_ttft, select_point
from shared.wire.schemas import FrontierPoint, LatencyFit, RecomputeConfig

# 12 layers; 1 ms per 1k tokens per layer of compute, nothing else.
FIT = LatencyFit(c0=0.0, c_tok=0.0, c_layer_tok=1e-6, c_attn=0.0, kv_bytes_per_token_layer=1000, e_bytes_per_token=2000)
FRONTIER = [
    FrontierPoint(0, 0, 0, 0.50),  # full reuse: below target
    FrontierPoint(2, 4, 2, 0.96),  # the chosen: fewest layers within 5% of 1.0
    FrontierPoint(2, 6, 4, 0.98),
    FrontierPoint(0, 8, 8, 1.00),
]
CFG = RecomputeConfig(sender_model="s", receiver_model="r", profile_version=1, task="qa", tolerance=0.05,
                      chosen=FRONTIER[1], frontier=FRONTIER, full_prefill_quality=1.0, full_reuse_quality=0.5,
                      total_layers=12, latency=FIT)


def test_queue_picks_fewest_layers_meeting_quality():
    """With requests queued (unlimited bandwidth) the fewest layers above the target win."""
    assert select_point(CFG, queued=3, tokens=4000) == FRONTIER[1]


def test_idle_with_slo_spends_spare_time_on_quality():
    """With no queue, the most recomputation whose estimate meets the SLO is chosen."""
    # 4000 tokens: k layers cost 4 ms each; an 18 ms SLO admits k = 4 but not k = 8.
    assert select_point(CFG, queued=0, tokens=4000, slo_s=0.018) == FRONTIER[2]
    assert select_point(CFG, queued=0, tokens=4000, slo_s=1.0) == FRONTIER[3]


def test_impossible_slo_falls_back_to_fastest():
    """An SLO no point meets yields the fastest eligible point, never one below target."""
    assert select_point(CFG, queued=0, tokens=4000, slo_s=1e-6) == FRONTIER[1]


def test_slow_link_pushes_towards_more_recompute():
    """On a slow link, recomputing more layers pulls fewer bytes and is estimated faster."""
    slow = 10e6  # 10 MB/s
    est = {p.recomputed_layers: estimated_ttft(CFG, p, 4000, slow) for p in FRONTIER[1:]}
    assert est[8] < est[4] < est[2]
    assert select_point(CFG, queued=3, tokens=4000, bandwidth_bps=slow) == FRONTIER[3]
