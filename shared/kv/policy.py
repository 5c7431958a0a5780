"""The reuse policy: from a request, a pair's config, a holder and online state to a plan and why.

Pure: no bus, no transport, no clock; the receiver calls `decide` once per request (on its event
loop; it never blocks) and `accepts` when a pair config arrives. The sequence:
  1. a forced mode wins (`full_prefill`, `full_reuse`: benchmarks and the demo's columns);
  2. no holder (the broker's miss reason is kept) -> full prefill; a holder (of any weights) that
     covers less than `min_reuse_fraction` of the prompt -> full prefill too (a shared opening, a
     chat template or a system prompt, would cost quality for little compute, or with the same
     weights a pull for a few tokens' compute; the reply then reports no reuse, not a "full
     reuse" of three tokens, and the receiver's own prefill is what it holds for the next request);
  3. the pair's config, if it was profiled for exactly these weights (both sha256s), picks an
     online point; a config for other weights is stale and ignored; a holder running the
     receiver's own weights needs no profile (`config_for`: full reuse is exact, still weighed);
  4. no config: the receiver's default group, if configured and the holder has its E;
  5. otherwise full prefill, with the reason.
Which online point, whether to relay at all, and the two corrections (`Calibration`, `QueueWait`)
that close the loop with measured TTFTs: docs/reference/reuse-policy.md, the derivation.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import CacheAvailable, CodecParams, FrontierPoint, LatencyFit, Mode, Path, PlanSpec, RecomputeConfig

Reason = tuple[str, str]  # (bounded code for metrics, text for the reply and the log)


@dataclasses.dataclass(frozen=True)
class Receiver:
    """What the policy needs to know about the receiver itself."""

    model_id: str
    model_sha256: str
    num_layers: int
    default_group: tuple[int, ...] = ()  # (start, end) used without a config; () = none
    # a holder of other weights must cover at least this share of the prompt's tokens
    min_reuse_fraction: float = 0.0


@dataclasses.dataclass(frozen=True)
class Online:
    """The receiver's state when the request is decided."""

    tokens: int  # prompt tokens
    queued: int = 0  # other requests in the receiver
    bandwidth_bps: float | None = None  # recent pull throughput from this holder; None = unknown (ignored)
    slo_s: float | None = None  # the request's TTFT objective, if any
    reused_tokens: int | None = None  # the holder's reusable prefix of the prompt (None: all but one token)
    reuse_overhead_s: float = 0.0  # what reuse costs before any layer moves (grant round trip), measured
    prefill_scale: float = 1.0  # `Calibration.scale(PREFILL_KIND)`: measured / fitted own-prefill TTFT
    reuse_scale: float = 1.0  # `Calibration.scale(reuse_kind(holder model))`: the same for reuse
    queue_wait_s: float = 0.0  # `QueueWait.wait(queued)`: expected wait for the compute thread, added to every option


@dataclasses.dataclass(frozen=True)
class Decision:
    plan: ReusePlan
    path: Path
    reason: Reason | None = None  # why the path is full prefill, when it is
    codec: str = "raw"
    codec_params: CodecParams = dataclasses.field(default_factory=dict)
    predicted_s: dict[str, float] = dataclasses.field(default_factory=dict)  # option -> predicted TTFT (with a fit)
    predicted_ttft_s: float | None = None  # the chosen option's
    raw_ttft_s: float | None = None  # a relay's, before calibration and the queue wait (what calibration learns)
    raw_s: dict[str, float] = dataclasses.field(default_factory=dict)  # the same before calibration
    weighed: bool = False  # relaying was possible and weighed (a holder, and a config or default group)
    relay_option: Decision | None = None  # when the policy chose its own prefill: the reuse it weighed


PREFILL_OPTION = "full prefill"


def accepts(cfg: RecomputeConfig, receiver: Receiver) -> bool:
    """Whether a published config is for this receiver's exact weights and layer count."""
    return (cfg.receiver_model == receiver.model_id and cfg.receiver_sha256 == receiver.model_sha256
            and cfg.total_layers == receiver.num_layers)


def config_for(holder: CacheAvailable, receiver: Receiver, configs: dict[str, RecomputeConfig]
               ) -> RecomputeConfig | None:
    """The config that governs reusing `holder`'s cache (the receiver calls it per request, with its
    configs by sender model): the pair's, or, for a holder running the receiver's own weights
    (another copy of the receiver's model, or an agent publishing its own output), `own_config`."""
    if holder.model_sha256 == receiver.model_sha256:
        return own_config(holder, receiver, configs.values())
    return configs.get(holder.model_id)


def own_config(holder: CacheAvailable, receiver: Receiver, configs: Iterable[RecomputeConfig]) -> RecomputeConfig:
    """The self pair: a holder with the receiver's own weights holds exactly the KV the receiver
    would compute (prefix caching), so full reuse is the one point, at quality 1 of 1. Whether it
    pays is still weighed: the latency fit and the audit's relay buckets are those of the newest
    config published for this receiver (they describe the receiver's compute, and relaying at a
    reusable fraction); with none, no fit, and reuse is chosen."""
    newest = max(configs, key=lambda c: c.created_at, default=None)
    point = FrontierPoint(plan=PlanSpec(groups=[]), recomputed_layers=0, quality=1.0)
    return RecomputeConfig(
        sender_model=holder.model_id, receiver_model=receiver.model_id, sender_sha256=receiver.model_sha256,
        receiver_sha256=receiver.model_sha256, profile_version=0, task="", tolerance=0.0, chosen=point,
        frontier=[point], full_prefill_quality=1.0, full_reuse_quality=1.0, total_layers=receiver.num_layers,
        latency=newest.latency if newest is not None else None, relay=list(newest.relay) if newest is not None else [])


def decide(mode: Mode, holder: CacheAvailable | None, miss: Reason | None, cfg: RecomputeConfig | None,
           receiver: Receiver, online: Online) -> Decision:
    """The plan for one request (see the module docstring for the order of the rules)."""
    if mode == "full_prefill":
        return _prefill(("forced", "full prefill requested"))
    if holder is None:
        return _prefill(miss or ("no_cache", "no cached prefix"))
    if mode == "full_reuse":
        return Decision(ReusePlan.full_reuse(), "full_reuse")
    reused = online.tokens - 1 if online.reused_tokens is None else online.reused_tokens
    if mode == "auto" and reused < receiver.min_reuse_fraction * online.tokens:
        return _prefill(("short_prefix", f"the holder's {holder.model_id} covers {reused} of {online.tokens} prompt "
                                         f"tokens, under min_reuse_fraction {receiver.min_reuse_fraction:g}"))
    if cfg is not None and cfg.sender_sha256 != holder.model_sha256:
        cfg = None
        stale: Reason | None = ("stale_config", f"the config for {holder.model_id} was profiled on other weights")
    else:
        stale = None
    if cfg is not None:
        return _weigh(cfg, holder, online)
    if receiver.default_group:
        s, e = receiver.default_group
        if s > 0 and s not in holder.e_layers:
            return _prefill(("no_e", f"sender holds no E for layer {s} (has {holder.e_layers})"))
        return dataclasses.replace(_reuse(ReusePlan.recompute(s, min(e, receiver.num_layers))), weighed=True)
    return _prefill(stale or ("no_config", f"no recompute config for {holder.model_id} -> {receiver.model_id}"))


def _weigh(cfg: RecomputeConfig, holder: CacheAvailable, online: Online) -> Decision:
    """Rule 3: the config's online point, against the receiver's own prefill when the config has a
    latency fit, and under the audit's relay buckets."""
    reused = online.reused_tokens
    p = select_point(cfg, queued=online.queued, tokens=online.tokens, slo_s=online.slo_s,
                     bandwidth_bps=online.bandwidth_bps, e_layers=set(holder.e_layers), reused=reused)
    chosen = dataclasses.replace(_reuse(plan_of(p.plan), p.plan), weighed=True)
    raw: dict[str, float] = {}
    if cfg.latency is not None:
        extra = online.reuse_overhead_s
        raw = {option_label(q): extra + estimated_ttft(cfg, q, online.tokens, online.bandwidth_bps, reused)
               for q in eligible(cfg, set(holder.e_layers))}
        raw.setdefault(option_label(p), extra + estimated_ttft(cfg, p, online.tokens, online.bandwidth_bps, reused))
        raw[PREFILL_OPTION] = prefill_seconds(cfg.latency, online.tokens, cfg.total_layers)
    options = {k: online.queue_wait_s + v * (online.prefill_scale if k == PREFILL_OPTION else online.reuse_scale)
               for k, v in raw.items()}
    veto = audit_veto(cfg.relay, online.tokens - 1 if reused is None else reused, online.tokens)
    mine = options.get(option_label(p))
    relay = dataclasses.replace(chosen, predicted_s=options, raw_s=raw, predicted_ttft_s=mine,
                                raw_ttft_s=raw.get(option_label(p)))
    if veto is not None:
        return dataclasses.replace(_prefill(veto), predicted_s=options, raw_s=raw,
                                   predicted_ttft_s=options.get(PREFILL_OPTION), weighed=True, relay_option=relay)
    if mine is None:
        return chosen
    own = options[PREFILL_OPTION]
    if own < mine:
        why = (f"predicted own prefill {own * 1e3:.0f} ms < reuse {mine * 1e3:.0f} ms ({option_label(p)}, "
               f"{reused if reused is not None else online.tokens - 1} of {online.tokens} tokens reusable)")
        return dataclasses.replace(_prefill(("prefill_faster", why)), predicted_s=options, raw_s=raw,
                                   predicted_ttft_s=own, weighed=True, relay_option=relay)
    return relay


def audit_veto(buckets: list[schemas.RelayBucket], reused: int, tokens: int) -> Reason | None:
    """Why the audit's policy forbids relaying at this reusable-prefix fraction, or None."""
    f = max(0.0, min(1.0, reused / max(1, tokens)))
    for b in buckets:
        if b.relay is False and (b.lo <= f < b.hi or f == b.hi == 1.0):
            return ("audit_policy", f"audit_policy: the relay audit found relaying slower at a reusable fraction in "
                                    f"[{b.lo:g}, {b.hi:g}) ({reused} of {tokens} tokens)")
    return None


PREFILL_KIND = "prefill"


def reuse_kind(sender_model: str) -> str:
    """The calibration kind of reusing a `sender_model` holder's cache."""
    return f"reuse:{sender_model}"


class Calibration:
    """Measured / predicted TTFT per kind (`PREFILL_KIND`, `reuse_kind(model)`), over the last
    `window` requests served that way. The receiver calls `observe` after each request it served
    with a prediction and `scale` per decision (its event loop; neither blocks). The scale is the
    median ratio once `min_samples` are in (1 before), clamped to [1/`clamp`, `clamp`] so one
    pathological stretch cannot silence a path; kinds are bounded (least recently seen go)."""

    def __init__(self, window: int = 64, min_samples: int = 5, clamp: float = 8.0, max_kinds: int = 256):
        self._window, self._min, self._clamp, self._max_kinds = window, min_samples, clamp, max_kinds
        self._ratios: dict[str, deque[float]] = {}

    def observe(self, kind: str, predicted_s: float, actual_s: float) -> None:
        if not (predicted_s > 0 and actual_s > 0) or predicted_s == float("inf") or actual_s == float("inf"):
            return
        ratios = self._ratios.pop(kind, None) or deque(maxlen=self._window)
        ratios.append(actual_s / predicted_s)
        self._ratios[kind] = ratios  # re-inserted: most recently seen last
        while len(self._ratios) > self._max_kinds:
            del self._ratios[next(iter(self._ratios))]

    def scale(self, kind: str) -> float:
        ratios = self._ratios.get(kind)
        if ratios is None or len(ratios) < self._min:
            return 1.0
        return min(self._clamp, max(1.0 / self._clamp, statistics.median(ratios)))


class QueueWait:
    """The expected wait behind the requests already in the receiver: each holds the compute thread
    about as long as the median of the last `window` requests' prefills did (their jobs on the
    thread; decoding is shared in the batch, which the receiver adds as its own delay). The
    receiver calls `observe` after each request and `wait` per decision (its event loop; neither
    blocks); 0 until `min_samples` are in. The wait is the same for every option: it makes the
    predicted TTFT (logged beside the actual one) include the queue, it does not change which
    option wins. Calibration learns compute only (the wait measured is taken off), so a burst does
    not skew the scales for the quiet time after it."""

    def __init__(self, window: int = 64, min_samples: int = 5):
        self._busy: deque[float] = deque(maxlen=window)
        self._min = min_samples

    def observe(self, busy_s: float) -> None:
        if 0 <= busy_s < float("inf"):
            self._busy.append(busy_s)

    def wait(self, queued: int) -> float:
        if queued <= 0 or len(self._busy) < self._min:
            return 0.0
        return queued * statistics.median(self._busy)


class PullRates:
    """What pulls achieved lately, in bytes/s (moving averages, weight `WEIGHT` on the newest): per
    holder, per link (a key naming where holders sit: their host for a network channel, this host
    for shm; `address.link_of`) and over every pull. A holder never pulled from is predicted at
    its link's rate, else at the rate over every holder: a new sender on a host already measured
    is not predicted at another host's rate. The receiver calls `observe` after each pull and
    `of` per decision (its event loop; neither blocks); at most `keep` holders and links each."""

    WEIGHT = 0.2

    def __init__(self, keep: int = 1024):
        self.overall: float | None = None
        self._holders: OrderedDict[str, float] = OrderedDict()
        self._links: OrderedDict[str, float] = OrderedDict()
        self._keep = keep

    def observe(self, holder: str, link: str, nbytes: int, seconds: float) -> None:
        if not (nbytes > 0 and 0 < seconds < float("inf")):
            return
        bps = nbytes / seconds
        self.overall = self._mixed(self.overall, bps)
        for table, key in ((self._holders, holder), (self._links, link)):
            table[key] = self._mixed(table.pop(key, None), bps)  # most recent last
            while len(table) > self._keep:  # bounded: senders and hosts come and go
                table.popitem(last=False)

    def of(self, holder: str, link: str) -> float | None:
        for table, key in ((self._holders, holder), (self._links, link)):
            if key in table:
                return table[key]
        return self.overall

    def _mixed(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.WEIGHT) * old + self.WEIGHT * new


def path_of(plan: ReusePlan) -> Path:
    """The reply's path for a plan the receiver served (patched layers are the receiver's own
    computation, so a patched full reuse is partial too)."""
    if plan.mode == "groups" or plan.patch:
        return "partial"
    if plan.mode in ("full_reuse", "cacheblend", "full_prefill"):
        return plan.mode
    raise ValueError(f"plan {plan.label()} is a probe, not a serving plan")


def plan_of(spec: PlanSpec) -> ReusePlan:
    """A published plan as the engine's `ReusePlan` (no groups: full reuse)."""
    return ReusePlan.recompute_groups(spec.groups).patched(spec.patch_layers)


def spec_of(plan: ReusePlan, codec: str = "raw", codec_params: CodecParams | None = None) -> PlanSpec:
    """The published form of a groups / full-reuse plan (its patch layers included)."""
    return PlanSpec(groups=[(s, e) for s, e in plan.groups], codec=codec, codec_params=dict(codec_params or {}),
                    patch_layers=list(plan.patch))


def _prefill(reason: Reason) -> Decision:
    return Decision(ReusePlan.full_prefill(), "full_prefill", reason)


def _reuse(plan: ReusePlan, spec: PlanSpec | None = None) -> Decision:
    if spec is None:
        return Decision(plan, path_of(plan))
    return Decision(plan, path_of(plan), codec=spec.codec, codec_params=dict(spec.codec_params))


# -- online choice among a config's frontier -----------------------------------------------
def prefill_seconds(fit: LatencyFit, tokens: int, layers: int) -> float:
    """The fitted compute time of running `layers` layers over `tokens` tokens."""
    return fit.c0 + fit.c_tok * tokens + fit.c_layer_tok * tokens * layers + fit.c_attn * tokens * tokens * layers


def transfer_seconds(fit: LatencyFit, tokens: int, e_count: int, reused_layers: int, bandwidth_bps: float | None
                     ) -> float:
    if not bandwidth_bps:
        return 0.0
    nbytes = tokens * (e_count * fit.e_bytes_per_token + reused_layers * fit.kv_bytes_per_token_layer)
    return nbytes / bandwidth_bps


def option_label(p: FrontierPoint) -> str:
    """A frontier point as a decision option: its plan, and its codec when not raw."""
    label = plan_of(p.plan).label()
    return label if p.plan.codec == "raw" else f"{label} ({p.plan.codec})"


def estimated_ttft(cfg: RecomputeConfig, p: FrontierPoint, tokens: int, bandwidth_bps: float | None,
                   reused: int | None = None) -> float:
    """Pipelined TTFT of point `p` for a `tokens`-token prompt whose first `reused` tokens (None:
    all but one) come from the holder: max(compute, transfer), compute = the recompute over the
    reused tokens + the rest of the prompt through every layer, transfer = the reused tokens' bytes."""
    if cfg.latency is None:
        return float(p.recomputed_layers)  # no fit: fewer layers is faster, all we know
    fit, L = cfg.latency, cfg.total_layers
    m = tokens - 1 if reused is None else max(0, min(reused, tokens))
    rest = tokens - m  # computed through all L layers, attending to the whole prompt
    compute = prefill_seconds(fit, m, p.recomputed_layers) + rest * (fit.c_layer_tok * L + fit.c_attn * tokens * L)
    if p.wire_bytes_per_token:  # a coded plan: the profiled bytes on the wire
        move = m * p.wire_bytes_per_token / bandwidth_bps if bandwidth_bps else 0.0
    else:
        e_count = len(plan_of(p.plan).e_layers)
        kept = L - p.recomputed_layers - len(p.plan.patch_layers)
        move = transfer_seconds(fit, m, e_count, kept, bandwidth_bps)
    return max(compute, move)


def eligible(cfg: RecomputeConfig, e_layers: set[int] | None = None) -> list[FrontierPoint]:
    """Frontier points meeting the quality target whose E the holder keeps (None: any); when it
    keeps none of them, those points with their groups extended down to E it keeps (never empty)."""
    target = (1.0 - cfg.tolerance) * cfg.full_prefill_quality
    pts = [p for p in cfg.frontier or [cfg.chosen] if p.quality >= target] or [cfg.chosen]
    if e_layers is None:
        return pts
    kept = [p for p in pts if set(plan_of(p.plan).e_layers) <= e_layers]
    # a patch layer's E cannot be replaced by recomputing more: such points are not extended
    return kept or [extended(p, e_layers) for p in pts if not p.plan.patch_layers] or pts


def extended(p: FrontierPoint, e_layers: set[int]) -> FrontierPoint:
    """`p` with each group [s, e) starting at s' = the nearest layer <= s that is 0 or in
    `e_layers`; groups that come to overlap merge. Quality is the profiled point's (a lower bound,
    see the module docstring)."""
    groups: list[tuple[int, int]] = []
    for s, e in p.plan.groups:  # ascending, disjoint
        start = max([l for l in e_layers if 0 <= l <= s], default=0)
        if groups and start <= groups[-1][1]:
            groups[-1] = (groups[-1][0], max(e, groups[-1][1]))
        else:
            groups.append((start, e))
    plan = PlanSpec(groups=groups, codec=p.plan.codec, codec_params=dict(p.plan.codec_params),
                    patch_layers=list(p.plan.patch_layers))
    return FrontierPoint(plan=plan, recomputed_layers=sum(e - s for s, e in groups), quality=p.quality,
                         wire_bytes_per_token=p.wire_bytes_per_token)  # fewer reused layers: an upper bound


def select_point(cfg: RecomputeConfig, *, queued: int, tokens: int, slo_s: float | None = None,
                 bandwidth_bps: float | None = None, e_layers: set[int] | None = None,
                 reused: int | None = None) -> FrontierPoint:
    """The frontier point for one request (see the module docstring)."""
    pts = eligible(cfg, e_layers)
    ttft = [estimated_ttft(cfg, p, tokens, bandwidth_bps, reused) for p in pts]
    fastest = min(range(len(pts)), key=lambda i: (ttft[i], pts[i].recomputed_layers))
    if queued > 0 or slo_s is None:
        return pts[fastest]
    within = [i for i in range(len(pts)) if ttft[i] <= slo_s]
    if not within:
        return pts[fastest]
    return pts[max(within, key=lambda i: (pts[i].recomputed_layers, pts[i].quality))]
