"""The relay audit's estimate: what relaying did to TTFT (and more), measured against the
randomized holdout, overall and per stratum.

Called by `shared/tools/cli/audit.py` (`run_audit`); its result feeds `relay.policy_proposal` and
`render`. Blocks on the CPU for the bootstrap (`n_boot` resamples per interval, ~4M indices at
once at most). It trusts the requests `logs.read_logs` kept; the arms' randomization is the
receivers' (`holdout_share`), taken as given.

Sequence (`run_audit`):
1. `logs.read_logs(DIR)`: the treatment, control and blind requests, shadow agreement joined.
2. `audit(logs)`: the average treatment effect (treatment mean - control mean) on TTFT (s),
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

The estimand is intent-to-treat: a treatment request whose relay fell back to full prefill still
counts as treatment (that fallback is part of what the policy costs). Randomization makes the
difference of means unbiased as long as the holdout share does not change with conditions; the
shares seen are reported (`holdout_shares`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from droidmesh.shared.audit.logs import SUFFIXES, Logs, Request, read_logs
from droidmesh.shared.audit.relay import REUSABLE_BUCKETS, bucket_label
from droidmesh.shared.errors import BadRequestError

CI_LEVEL = 0.95
TOP_STRATUM = "reusable=[0.95,1]"
# (label, low, high): a value in [low, high).
CONTEXT_BUCKETS = (("<1K", 0, 1024), ("[1K,4K)", 1024, 4096), (">=4K", 4096, math.inf))
LOAD_BUCKETS = (("0", 0, 1), ("1-3", 1, 4), (">=4", 4, math.inf))


# ---- effects -------------------------------------------------------------------------------

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


# (dimension, label of a request or None, labels always listed)
DIMENSIONS: tuple[tuple[str, Callable[[Request], str | None], tuple[str, ...]], ...] = (
    ("reusable", lambda r: bucket_label(REUSABLE_BUCKETS, r.reusable_fraction), tuple(b[0] for b in REUSABLE_BUCKETS)),
    ("context", lambda r: bucket_label(CONTEXT_BUCKETS, r.prompt_tokens), tuple(b[0] for b in CONTEXT_BUCKETS)),
    ("pair", lambda r: r.pair, ()),
    ("topology", lambda r: r.topology, ()),
    ("load", lambda r: bucket_label(LOAD_BUCKETS, r.queued), tuple(b[0] for b in LOAD_BUCKETS)),
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


# ---- summary figures -----------------------------------------------------------------------

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
