"""Online choice of a frontier point for one request (DroidSpeak Appendix B, plus bandwidth).

Estimated TTFT of recomputing k of L layers on a T-token context, pipelined (E first, recompute
while the reused KV streams):
    ttft(k) = max(recompute(T, k), transfer(T, k)) + suffix
    recompute(T, k) = latency model at k layers;  transfer(T, k) = (E + (L-k) KV layers) / bandwidth
Rules, among frontier points whose quality meets the target (>= (1 - tolerance) x full prefill):
  - requests queued: the point with the lowest estimated TTFT (with unlimited bandwidth that is
    the fewest recomputed layers, the paper's rule); queueing makes every second count;
  - nothing queued: the most recomputation whose estimated TTFT still meets the request's SLO
    (quality for free), else the lowest estimated TTFT.
A slow link pushes the choice towards recomputing more layers (fewer bytes to pull), which the
paper leaves to future work.
"""

from __future__ import annotations

from shared.wire.schemas import FrontierPoint, LatencyFit, RecomputeConfig


def prefill_seconds(fit: LatencyFit, tokens: int, layers: int) -> float:
    """The fitted compute time of running `layers` layers over `tokens` tokens."""
    return fit.c0 + fit.c_tok * tokens + fit.c_layer_tok * tokens * layers + fit.c_attn * tokens * tokens * layers


def transfer_seconds(fit: LatencyFit, tokens: int, reused_layers: int, bandwidth_bps: float | None) -> float:
    if not bandwidth_bps:
        return 0.0
    nbytes = tokens * (fit.e_bytes_per_token + reused_layers * fit.kv_bytes_per_token_layer)
    return nbytes / bandwidth_bps


def estimated_ttft(cfg: RecomputeConfig, p: FrontierPoint, tokens: int, bandwidth_bps: float | None) -> float:
    if cfg.latency is None:
        return float(p.recomputed_layers)  # no fit: fewer layers is faster, all we know
    fit = cfg.latency
    compute = prefill_seconds(fit, tokens, p.recomputed_layers)
    move = transfer_seconds(fit, tokens, cfg.total_layers - p.recomputed_layers, bandwidth_bps)
    return max(compute, move)


def eligible(cfg: RecomputeConfig, e_layers: set[int] | None = None) -> list[FrontierPoint]:
    """Frontier points meeting the quality target whose E the sender holds (None: any)."""
    target = (1.0 - cfg.tolerance) * cfg.full_prefill_quality
    pts = [p for p in cfg.frontier or [cfg.chosen] if p.quality >= target] or [cfg.chosen]
    if e_layers is not None:
        pts = [p for p in pts if p.end == p.start or p.start == 0 or p.start in e_layers]
    return pts


def select_point(cfg: RecomputeConfig, *, queued: int, tokens: int, slo_s: float | None = None,
                 bandwidth_bps: float | None = None, e_layers: set[int] | None = None) -> FrontierPoint | None:
    """The frontier point to use for one request (see the module docstring for the rules);
    None when the sender holds E for no eligible point."""
    pts = eligible(cfg, e_layers)
    if not pts:
        return None
    ttft = {(p.start, p.end): estimated_ttft(cfg, p, tokens, bandwidth_bps) for p in pts}
    fastest = min(pts, key=lambda p: (ttft[(p.start, p.end)], p.recomputed_layers))
    if queued > 0 or slo_s is None:
        return fastest
    within = [p for p in pts if ttft[(p.start, p.end)] <= slo_s]
    return max(within, key=lambda p: (p.recomputed_layers, p.quality)) if within else fastest
