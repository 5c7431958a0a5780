"""The causal audit of KV relay (paper 004): what relaying did, measured against a randomized holdout.

Sequence (`run_audit`):
1. `read_logs(DIR)`: every `*.log` / `*.jsonl` / `*.txt` file under DIR (recursively), line by
   line. A line is a JSON object, possibly after a prefix (`docker compose logs` writes
   "receiver-1  | {...}"); anything else is skipped. Receivers' `event == "request"` lines whose
   `assignment` is "treatment" (served as the policy chose: relayed, or its own prefill when that
   was predicted faster), "control" (randomized holdout: full prefill whatever the policy chose)
   or "blind" (randomized: relayed whatever the policy chose), all only where relaying was
   possible, become `Request`s; `event == "shadow"` lines give a
   relayed answer's token `agreement` with a full-prefill shadow, joined by `request_id`. A
   request id seen twice (a log collected twice) counts once.
2. `audit(requests)`: the average treatment effect (treatment mean - control mean) on TTFT (s),
   end-to-end latency (`stages_ms["done"]`, s), bytes pulled and shadow agreement, with percentile
   bootstrap intervals (treatment and control resampled separately, seeded per stratum), overall
   and per stratum: reusable-prefix fraction, prompt length, sender -> receiver pair, topology and
   load (requests queued at decision time). A stratum without control or treatment requests has
   null effects. The control's agreement is 1 by definition (its answer is a full prefill, the
   shadow's own reference), so the agreement effect is mean(treatment agreement) - 1. The blind
   arm gets the same TTFT effect against the control per stratum (`blind_*`): relaying itself.
3. The summary figures: `worst_stratum_ratio` (largest policy p50 / full-prefill p50 TTFT over
   strata with both; `blind_worst_stratum_ratio` the same for blind relay), `top_stratum_speedup`
   (full-prefill p50 / policy p50 for reusable [0.95,1]), `prediction_error` (median |predicted -
   actual| / actual TTFT of the served option, over requests with a prediction), `decision_p99_s`
   (the policy's own time per request).
4. `policy_proposal`: the policy file below; `format_report` prints, `plot_png` draws.

The estimand is intent-to-treat: a treatment request whose relay fell back to full prefill still
counts as treatment (that fallback is part of what the policy costs). Randomization makes the
difference of means unbiased as long as the holdout share does not change with conditions; the
shares seen are reported (`holdout_shares`).

Policy file (`--policy OUT.json`); `droidmesh config relay-policy OUT.json` writes its buckets into
the published pair configs (`RecomputeConfig.relay`), which receivers load hot:

    {
      "schema": "droidmesh.audit.policy/1",
      "generated_from": {"files": 3, "requests_used": 812, "bootstrap": 2000, "seed": 0, "ci_level": 0.95},
      "buckets": [                                   # reusable-prefix fraction buckets, highest first
        {"label": "[0.95,1]", "reusable_fraction": [0.95, 1.0],
         "relay": true,                              # true: CI upper bound < 0 (relaying significantly faster)
                                                     # false: CI lower bound > 0 (significantly slower)
                                                     # null: undecided (CI spans 0, or < 5 requests in an arm)
         "evidence": "blind",                        # the arm against the control: "blind" (relaying itself,
                                                     # when it has >= 5 requests) or "treatment" (the policy)
         "ate_ttft_s": -0.21, "ci_low": -0.25, "ci_high": -0.17, "treatment": 300, "control": 40},
        ...
      ],
      "min_reusable_fraction": 0.85                  # lower bound of the lowest bucket of the run of
    }                                                # relay=true buckets from the top; null if [0.95,1] is not true
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.mesh.config_board import MAX_RELAY_BUCKETS
from droidmesh.shared.wire.schemas import RecomputeConfig, RelayBucket

SUFFIXES = (".log", ".jsonl", ".txt")
ARMS = ("treatment", "control", "blind")
CI_LEVEL = 0.95
MIN_POLICY_ARM = 5  # a bucket's relay decision needs this many treatment and control requests
POLICY_SCHEMA = "droidmesh.audit.policy/1"
# (label, low, high): reusable fraction in [low, high); the top bucket includes 1.
REUSABLE_BUCKETS = (("[0.95,1]", 0.95, math.inf), ("[0.85,0.95)", 0.85, 0.95), ("[0.7,0.85)", 0.7, 0.85), ("<0.7", 0.0, 0.7))
TOP_STRATUM = "reusable=[0.95,1]"
CONTEXT_BUCKETS = (("<1K", 0, 1024), ("[1K,4K)", 1024, 4096), (">=4K", 4096, math.inf))
LOAD_BUCKETS = (("0", 0, 1), ("1-3", 1, 4), (">=4", 4, math.inf))
COLUMNS = ("stratum", "requests", "treatment", "control", "ate_ttft_s", "ci_low", "ci_high",
           "policy_p50_ttft_s", "full_prefill_p50_ttft_s", "quality_agreement", "blind", "blind_p50_ttft_s")


@dataclass(frozen=True)
class Request:
    """One treatment or control request, in seconds and bytes."""

    request_id: str | None
    assignment: str
    ttft_s: float
    e2e_s: float | None
    bytes_pulled: float | None
    predicted_ttft_s: float | None
    reusable_fraction: float | None
    prompt_tokens: int | None
    pair: str | None
    topology: str | None
    queued: int | None
    holdout_share: float | None
    agreement: float | None = None
    decision_s: float | None = None  # the policy's own time deciding (and assigning) the request


@dataclass
class Logs:
    requests: list[Request]
    files: int
    lines_read: int
    other_assignments: int  # request lines outside the experiment ("ineligible", or none logged)
    malformed: int  # treatment/control lines without a usable ttft_ms
    duplicates: int


# ---- 1. reading ----------------------------------------------------------------------------

def log_files(root: str | Path) -> list[Path]:
    d = Path(root)
    if not d.is_dir():
        raise BadRequestError(f"--logs {root}: no such directory")
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON object on `line` (after any prefix), or None."""
    start = line.find("{")
    if start < 0:
        return None
    try:
        obj = json.loads(line[start:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _ms(v: Any) -> float | None:
    x = _num(v)
    return None if x is None or x < 0 else x / 1e3


def to_request(obj: dict[str, Any]) -> Request | None:
    """A `Request` from a treatment/control request line, or None without a usable TTFT."""
    ttft = _ms(obj.get("ttft_ms"))
    if ttft is None:
        return None
    stages = obj.get("stages_ms")
    sender, receiver = obj.get("sender_model"), obj.get("receiver_model")
    queued, prompt = _num(obj.get("queued")), _num(obj.get("prompt_tokens"))
    rid = obj.get("request_id")
    return Request(request_id=str(rid) if rid is not None else None, assignment=obj["assignment"], ttft_s=ttft,
                   e2e_s=_ms(stages.get("done")) if isinstance(stages, dict) else None,
                   bytes_pulled=_num(obj.get("bytes_pulled")), predicted_ttft_s=_ms(obj.get("predicted_ttft_ms")),
                   reusable_fraction=_num(obj.get("reusable_fraction")),
                   prompt_tokens=int(prompt) if prompt is not None else None,
                   pair=f"{sender or '?'}->{receiver or '?'}" if sender or receiver else None,
                   topology=obj.get("topology") if isinstance(obj.get("topology"), str) else None,
                   queued=int(queued) if queued is not None else None, holdout_share=_num(obj.get("holdout_share")),
                   decision_s=_ms(obj.get("decision_ms")))


def read_logs(root: str | Path) -> Logs:
    files = log_files(root)
    requests: dict[str, Request] = {}
    anonymous: list[Request] = []
    agreements: dict[str, float] = {}
    lines = other = malformed = duplicates = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                lines += 1
                obj = parse_line(line)
                if obj is None:
                    continue
                if obj.get("event") == "shadow" and obj.get("request_id") is not None:
                    if (a := _num(obj.get("agreement"))) is not None:
                        agreements[str(obj["request_id"])] = a
                    continue
                if obj.get("event") != "request":
                    continue
                if obj.get("assignment") not in ARMS:
                    other += 1
                    continue
                req = to_request(obj)
                if req is None:
                    malformed += 1
                elif req.request_id is None:
                    anonymous.append(req)
                elif req.request_id in requests:
                    duplicates += 1
                else:
                    requests[req.request_id] = req
    joined = [_with_agreement(r, agreements.get(r.request_id or "")) for r in requests.values()]
    return Logs(joined + anonymous, len(files), lines, other, malformed, duplicates)


def _with_agreement(r: Request, agreement: float | None) -> Request:
    return r if agreement is None else dataclasses.replace(r, agreement=agreement)


# ---- 2. effects ----------------------------------------------------------------------------

def _rng(seed: int, key: str) -> np.random.Generator:
    """A generator per (seed, stratum, metric): a stratum's interval does not depend on the others."""
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _boot_means(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(n)
    step = max(1, 4_000_000 // len(x))  # bounded memory: at most ~4M indices at once
    for i in range(0, n, step):
        k = min(step, n - i)
        out[i:i + k] = x[rng.integers(0, len(x), size=(k, len(x)))].mean(axis=1)
    return out


def effect(treated: Sequence[float], control: Sequence[float], n_boot: int, rng: np.random.Generator) -> dict[str, Any]:
    """Difference of means with a percentile bootstrap interval; nulls when an arm is empty, and
    no interval when an arm has one value (resampling it would claim that arm has no variance)."""
    t, c = np.asarray(treated, dtype=float), np.asarray(control, dtype=float)
    out: dict[str, Any] = {"ate": None, "ci_low": None, "ci_high": None, "treatment": len(t), "control": len(c)}
    if len(t) == 0 or len(c) == 0:
        return out
    out["ate"] = float(t.mean() - c.mean())
    if n_boot > 0 and min(len(t), len(c)) >= 2:
        diffs = _boot_means(t, n_boot, rng) - _boot_means(c, n_boot, rng)
        tail = (1 - CI_LEVEL) / 2 * 100
        lo, hi = np.percentile(diffs, [tail, 100 - tail])
        out["ci_low"], out["ci_high"] = float(lo), float(hi)
    return out


def _values(reqs: Iterable[Request], arm: str, field: str) -> list[float]:
    return [v for r in reqs if r.assignment == arm and (v := getattr(r, field)) is not None]


def _median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def stratum_row(name: str, reqs: Sequence[Request], n_boot: int, seed: int) -> dict[str, Any]:
    t, c = _values(reqs, "treatment", "ttft_s"), _values(reqs, "control", "ttft_s")
    eff = effect(t, c, n_boot, _rng(seed, f"{name}/ttft_s"))
    agree = _values(reqs, "treatment", "agreement")
    b = _values(reqs, "blind", "ttft_s")
    blind = effect(b, c, n_boot, _rng(seed, f"{name}/blind"))
    return {"stratum": name, "requests": len(reqs), "treatment": len(t), "control": len(c),
            "ate_ttft_s": eff["ate"], "ci_low": eff["ci_low"], "ci_high": eff["ci_high"],
            "policy_p50_ttft_s": _median(t), "full_prefill_p50_ttft_s": _median(c),
            "quality_agreement": float(np.mean(agree)) if agree else None,
            "blind": len(b), "blind_ate_ttft_s": blind["ate"], "blind_ci_low": blind["ci_low"],
            "blind_ci_high": blind["ci_high"], "blind_p50_ttft_s": _median(b)}


def effects(reqs: Sequence[Request], n_boot: int, seed: int) -> dict[str, dict[str, Any]]:
    """The overall effects on TTFT, end-to-end latency, bytes pulled and shadow agreement."""
    out = {name: effect(_values(reqs, "treatment", f), _values(reqs, "control", f), n_boot, _rng(seed, f"overall/{name}"))
           for name, f in (("ttft_s", "ttft_s"), ("e2e_s", "e2e_s"), ("bytes", "bytes_pulled"))}
    agree = _values(reqs, "treatment", "agreement")
    control = [1.0] * len(_values(reqs, "control", "ttft_s")) if agree else []  # full prefill: agreement 1
    out["agreement"] = effect(agree, control, n_boot, _rng(seed, "overall/agreement"))
    return out


def reusable_bucket(fraction: float) -> str:
    """The reusable-prefix stratum of a fraction in [0, 1] (the dashboard counts by it too)."""
    return _bucket(REUSABLE_BUCKETS, max(0.0, fraction)) or REUSABLE_BUCKETS[-1][0]


def _bucket(buckets: Sequence[tuple[str, float, float]], x: float | None) -> str | None:
    if x is None:
        return None
    return next((label for label, lo, hi in buckets if lo <= x < hi), None)


# (dimension, label of a request or None, labels always listed)
DIMENSIONS: tuple[tuple[str, Callable[[Request], str | None], tuple[str, ...]], ...] = (
    ("reusable", lambda r: _bucket(REUSABLE_BUCKETS, r.reusable_fraction), tuple(b[0] for b in REUSABLE_BUCKETS)),
    ("context", lambda r: _bucket(CONTEXT_BUCKETS, r.prompt_tokens), tuple(b[0] for b in CONTEXT_BUCKETS)),
    ("pair", lambda r: r.pair, ()),
    ("topology", lambda r: r.topology, ()),
    ("load", lambda r: _bucket(LOAD_BUCKETS, r.queued), tuple(b[0] for b in LOAD_BUCKETS)),
)


def strata(reqs: Sequence[Request]) -> list[tuple[str, list[Request]]]:
    """(name, requests) per stratum: fixed buckets always (maybe empty), pairs and topologies as seen."""
    out = []
    for dim, label_of, fixed in DIMENSIONS:
        groups: dict[str, list[Request]] = {label: [] for label in fixed}
        for r in reqs:
            if (label := label_of(r)) is not None:
                groups.setdefault(label, []).append(r)
        names = list(fixed) + sorted(set(groups) - set(fixed))
        out += [(f"{dim}={label}", groups[label]) for label in names]
    return out


# ---- 3. summary figures --------------------------------------------------------------------

def worst_stratum(rows: Sequence[dict[str, Any]], arm: str = "policy") -> tuple[str | None, float | None]:
    ratios = [(r[f"{arm}_p50_ttft_s"] / r["full_prefill_p50_ttft_s"], r["stratum"]) for r in rows
              if r[f"{arm}_p50_ttft_s"] is not None and r["full_prefill_p50_ttft_s"]]
    if not ratios:
        return None, None
    ratio, name = max(ratios)
    return name, ratio


def top_stratum_speedup(rows: Sequence[dict[str, Any]]) -> float | None:
    row = next((r for r in rows if r["stratum"] == TOP_STRATUM), None)
    if row is None or row["full_prefill_p50_ttft_s"] is None or not row["policy_p50_ttft_s"]:
        return None
    return row["full_prefill_p50_ttft_s"] / row["policy_p50_ttft_s"]


def prediction_error(reqs: Iterable[Request]) -> float | None:
    errs = [abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in reqs
            if r.predicted_ttft_s is not None and r.ttft_s > 0]
    return _median(errs)


def decision_p99(reqs: Iterable[Request]) -> float | None:
    """p99 of the policy's own decision time, seconds (nearest rank)."""
    xs = sorted(r.decision_s for r in reqs if r.decision_s is not None)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else None


def audit(logs: Logs, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    reqs = logs.requests
    rows = [stratum_row(name, group, n_boot, seed) for name, group in strata(reqs)]
    overall = {**stratum_row("overall", reqs, n_boot, seed), "effects": effects(reqs, n_boot, seed)}
    worst_name, worst = worst_stratum(rows)
    shares = sorted({r.holdout_share for r in reqs if r.holdout_share is not None})
    blind_name, blind_worst = worst_stratum(rows, "blind")
    return {"strata": rows, "overall": overall, "worst_stratum_ratio": worst, "worst_stratum": worst_name,
            "blind_worst_stratum_ratio": blind_worst, "blind_worst_stratum": blind_name,
            "top_stratum_speedup": top_stratum_speedup(rows), "prediction_error": prediction_error(reqs),
            "decision_p99_s": decision_p99(reqs),
            "files": logs.files, "lines_read": logs.lines_read, "requests_used": len(reqs),
            "other_request_lines": logs.other_assignments, "malformed_request_lines": logs.malformed,
            "duplicate_request_lines": logs.duplicates, "holdout_shares": shares,
            "bootstrap": n_boot, "seed": seed, "ci_level": CI_LEVEL}


def run_audit(root: str | Path, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    logs = read_logs(root)
    if not logs.files:
        raise BadRequestError(f"--logs {root}: no {'/'.join('*' + s for s in SUFFIXES)} files under it")
    if not logs.requests:
        raise BadRequestError(f"--logs {root}: no usable request lines (assignment treatment or control) in "
                              f"{logs.lines_read} lines of {logs.files} files; receivers log them with holdout_share > 0")
    return audit(logs, n_boot, seed)


# ---- 4. outputs ----------------------------------------------------------------------------

def relay_decision(row: dict[str, Any], arm: str = "treatment") -> bool | None:
    """True where relaying (`arm` "treatment": as the policy chose; "blind": always) is
    significantly faster than the control (CI < 0), False where slower (CI > 0), else None (also
    with fewer than MIN_POLICY_ARM requests in an arm: a bootstrap of a handful says little)."""
    pre = "" if arm == "treatment" else f"{arm}_"
    if min(row[arm], row["control"]) < MIN_POLICY_ARM:
        return None
    if row[f"{pre}ci_high"] is not None and row[f"{pre}ci_high"] < 0:
        return True
    if row[f"{pre}ci_low"] is not None and row[f"{pre}ci_low"] > 0:
        return False
    return None


def policy_proposal(result: dict[str, Any]) -> dict[str, Any]:
    """The policy file (schema in the module docstring) from an `audit` result."""
    by_name = {r["stratum"]: r for r in result["strata"]}
    buckets, floor, run = [], None, True
    for label, lo, hi in REUSABLE_BUCKETS:
        row = by_name[f"reusable={label}"]
        # Blind relay measures relaying itself (also where a veto stopped the policy): its
        # verdict wins once it has the requests; else the policy's own arm.
        arm = "blind" if min(row["blind"], row["control"]) >= MIN_POLICY_ARM else "treatment"
        relay = relay_decision(row, arm)
        run = run and relay is True
        floor = lo if run else floor
        pre = "" if arm == "treatment" else "blind_"
        buckets.append({"label": label, "reusable_fraction": [lo, min(hi, 1.0)], "relay": relay, "evidence": arm,
                        "ate_ttft_s": row[f"{pre}ate_ttft_s"], "ci_low": row[f"{pre}ci_low"],
                        "ci_high": row[f"{pre}ci_high"], "treatment": row[arm], "control": row["control"]})
    return {"schema": POLICY_SCHEMA,
            "generated_from": {k: result[k] for k in ("files", "requests_used", "bootstrap", "seed", "ci_level")},
            "buckets": buckets, "min_reusable_fraction": floor}


def read_relay_policy(path: str | Path) -> list[RelayBucket]:
    """The buckets of the policy file at `path` (`BadRequestError` for one that is not JSON or not a policy)."""
    try:
        policy = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequestError(f"{path} is not JSON ({e})") from None
    return relay_buckets(policy, str(path))


def relay_buckets(policy: Any, where: str = "the policy file") -> list[RelayBucket]:
    """The relay buckets of a policy file (as `policy_proposal` writes it), checked: the schema,
    at most MAX_RELAY_BUCKETS buckets, each fraction range inside [0, 1] and relay true/false/null.
    Raises `BadRequestError` naming the first problem."""
    if not isinstance(policy, dict) or policy.get("schema") != POLICY_SCHEMA:
        raise BadRequestError(f"{where} is not a relay policy (schema {POLICY_SCHEMA!r})")
    raw = policy.get("buckets")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_RELAY_BUCKETS:
        raise BadRequestError(f"{where}: buckets must be a list of 1 to {MAX_RELAY_BUCKETS}")
    out = []
    for i, b in enumerate(raw):
        rng = b.get("reusable_fraction") if isinstance(b, dict) else None
        relay = b.get("relay") if isinstance(b, dict) else None
        if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int | float) for x in rng)
                and 0 <= rng[0] < rng[1] <= 1) or relay not in (True, False, None):
            raise BadRequestError(f"{where}: bucket {i} needs reusable_fraction [lo, hi] with 0 <= lo < hi <= 1 "
                                  f"and relay true, false or null")
        out.append(RelayBucket(lo=float(rng[0]), hi=float(rng[1]), relay=relay))
    return out


def with_relay(cfg: RecomputeConfig, buckets: list[RelayBucket], version: int) -> RecomputeConfig:
    """`cfg` carrying the audit's `buckets` as `version`. An undecided bucket (relay null) keeps the
    verdict `cfg` already had for the same range: once a bucket is vetoed its requests are no longer
    relayed, so a later audit cannot see relaying there and would otherwise lift the veto."""
    before = {(b.lo, b.hi): b for b in cfg.relay}
    merged = [b if b.relay is not None else before.get((b.lo, b.hi), b) for b in buckets]
    return msgspec.structs.replace(cfg, relay=merged, profile_version=version, created_at=time.time())


def format_report(result: dict[str, Any]) -> str:
    from droidmesh.shared.bench.report import format_table

    o = result["overall"]
    lines = [format_table([o, *result["strata"]], COLUMNS), ""]
    for name, unit in (("ttft_s", "s"), ("e2e_s", "s"), ("bytes", "B"), ("agreement", "")):
        e = o["effects"][name]
        ci = f" [{e['ci_low']:.4g}, {e['ci_high']:.4g}]" if e["ci_low"] is not None else ""
        value = f"{e['ate']:.4g}{unit}{ci}" if e["ate"] is not None else "n/a"
        lines.append(f"effect of relaying on {name}: {value} ({e['treatment']} treatment, {e['control']} control)")
    fig = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    lines.append(f"worst stratum ratio {fig(result['worst_stratum_ratio'])} ({result['worst_stratum'] or '-'}), "
                 f"blind relay's {fig(result['blind_worst_stratum_ratio'])} ({result['blind_worst_stratum'] or '-'}); "
                 f"top stratum speedup {fig(result['top_stratum_speedup'])}; "
                 f"prediction error (median relative) {fig(result['prediction_error'])}; "
                 f"decision p99 {fig(result['decision_p99_s'] * 1e3 if result['decision_p99_s'] is not None else None)} ms")
    lines.append(f"{result['requests_used']} requests from {result['lines_read']} lines in {result['files']} files "
                 f"({result['other_request_lines']} outside the experiment, {result['malformed_request_lines']} malformed, "
                 f"{result['duplicate_request_lines']} duplicates); {CI_LEVEL:.0%} CI, {result['bootstrap']} resamples")
    return "\n".join(lines)


def plot_png(result: dict[str, Any], path: str | Path) -> None:
    """Per stratum ATE on TTFT with its CI, horizontal bars (first stratum on top), blind relay's as
    a marker under each; no-data strata labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from droidmesh.shared.bench.report import label_bars

    rows = [result["overall"], *result["strata"]]
    y = np.arange(len(rows))[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.4))
    have = [(yy, r) for yy, r in zip(y, rows, strict=True) if r["ate_ttft_s"] is not None]
    ates = [r["ate_ttft_s"] * 1e3 for _, r in have]
    err = [[(r["ate_ttft_s"] - r["ci_low"]) * 1e3 if r["ci_low"] is not None else 0 for _, r in have],
           [(r["ci_high"] - r["ate_ttft_s"]) * 1e3 if r["ci_high"] is not None else 0 for _, r in have]]
    colours = ["C2" if relay_decision(r) else "C3" if relay_decision(r) is False else "0.6" for _, r in have]
    bars = ax.barh([yy for yy, _ in have], ates, 0.6, xerr=err, color=colours, alpha=0.8, capsize=2, ecolor="k")
    label_bars(ax, bars, "{:.1f}")
    blind = [(yy, r) for yy, r in zip(y, rows, strict=True) if r.get("blind_ate_ttft_s") is not None]
    if blind:  # relaying itself (the blind arm), under each bar
        ax.errorbar([r["blind_ate_ttft_s"] * 1e3 for _, r in blind], [yy - 0.3 for yy, _ in blind],
                    xerr=[[(r["blind_ate_ttft_s"] - (r["blind_ci_low"] or r["blind_ate_ttft_s"])) * 1e3 for _, r in blind],
                          [((r["blind_ci_high"] or r["blind_ate_ttft_s"]) - r["blind_ate_ttft_s"]) * 1e3 for _, r in blind]],
                    fmt="D", ms=3, c="C1", lw=0.8, capsize=2, label="blind relay (always relay) vs control")
        ax.legend(fontsize=7, loc="lower right")
    for yy, r in zip(y, rows, strict=True):
        if r["ate_ttft_s"] is None:
            ax.annotate("no data" if not r["requests"] else "one arm only", (0, yy), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=6, color="0.4")
    ax.axvline(0, c="k", lw=0.8)
    ax.set_yticks(y, [f"{r['stratum']} ({r['treatment']}/{r['control']})" for r in rows], fontsize=7)
    ax.set_xlabel(f"effect of relaying on TTFT, ms (treatment - control, {CI_LEVEL:.0%} CI); green: relay pays")
    ax.set_title(f"KV relay audit: {result['requests_used']} requests (treatment/control per stratum)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
