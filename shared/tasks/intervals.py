"""95 % intervals for the verdicts of quality claims, and the 5 % rule applied to them.

  - `wilson(k, n)`: a proportion's interval (agreement rates, an attacker's accuracy): valid near
    0 and 1, where p ± z·se is not;
  - `paired(reference, other)`: the mean paired difference `other - reference` over the same rows
    with a percentile bootstrap interval (rows, or groups of rows that share a document,
    resampled with replacement; one seed: the same rows give the same interval), and that
    difference relative to the reference's mean;
  - `verdict(...)`: the 5 % rule on the relative interval — "within" when its lower end is at or
    above -5 %, "below" when its upper end is under -5 %, otherwise "undecided": the rows cannot
    tell, and the verdict says so rather than reading the mean.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Hashable, Sequence

Z95 = 1.959963984540054
TOLERANCE = 0.05  # the 5 % rule: a plan is within it when it loses at most this share of the reference


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (valid near 0 and 1, unlike p +- z*se)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass(frozen=True)
class Paired:
    """`other - reference` on the same rows: the mean difference and its 95 % interval, absolute
    and relative to the reference's mean (relative ones are None when that mean is 0)."""

    rows: int
    reference_mean: float
    other_mean: float
    diff: float
    lo: float
    hi: float
    rel: float | None
    rel_lo: float | None
    rel_hi: float | None

    def verdict(self, tolerance: float = TOLERANCE) -> str:
        if self.rel_lo is None or self.rel_hi is None:
            return "undecided"
        if self.rel_lo >= -tolerance:
            return "within"
        if self.rel_hi < -tolerance:
            return "below"
        return "undecided"


def versus_json(p: Paired) -> dict[str, object]:
    """A verdict against the reference as reports store it (`vs_full_prefill`): the relative
    difference, its interval (None where some resample's reference mean is 0) and the 5 % rule."""
    return {"relative": None if p.rel is None else round(p.rel, 4),
            "interval": None if p.rel_lo is None or p.rel_hi is None else [round(p.rel_lo, 4), round(p.rel_hi, 4)],
            "verdict": p.verdict()}


def versus_text(v: dict | None) -> str:
    """`versus_json`'s dict as one line: `+1.2% [-3.4%, +5.6%] within` ('' for none)."""
    if not v:
        return ""
    if v["relative"] is None:
        return "n/a (full prefill scores 0)"
    if v["interval"] is None:  # some resample of documents has full prefill scoring 0
        return f"{v['relative']:+.1%}, no interval (too few rows)"
    lo, hi = v["interval"]
    return f"{v['relative']:+.1%} [{lo:+.1%}, {hi:+.1%}] {v['verdict']}"


def paired(reference: Sequence[float], other: Sequence[float], n_boot: int = 4000, seed: int = 0,
           groups: Sequence[Hashable] | None = None) -> Paired:
    """The paired difference `other - reference` over the same rows, with a percentile bootstrap
    95 % interval; relative figures divide by the reference's mean in the same resample. With
    `groups` (one id per row: rows asking about one document share it), whole groups are
    resampled: rows of one document are not independent, and resampling them one by one would
    make the interval too narrow."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"paired rows: {len(reference)} and {len(other)}; need the same, at least one")
    if groups is not None and len(groups) != len(reference):
        raise ValueError(f"{len(groups)} group ids for {len(reference)} rows")
    n = len(reference)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups if groups is not None else range(n)):
        members.setdefault(g, []).append(i)
    clusters = list(members.values())
    rng = random.Random(seed)
    diffs, rels = [], []
    for _ in range(n_boot):
        idx = [i for _ in clusters for i in clusters[rng.randrange(len(clusters))]]
        ref = sum(reference[i] for i in idx) / len(idx)
        oth = sum(other[i] for i in idx) / len(idx)
        diffs.append(oth - ref)
        if ref > 0:
            rels.append((oth - ref) / ref)
    diffs.sort()
    rels.sort()
    ref_mean, oth_mean = sum(reference) / n, sum(other) / n
    lo, hi = _percentiles(diffs)
    # relative only where every resample has a positive reference mean: else it is not defined
    rel_lo, rel_hi = _percentiles(rels) if len(rels) == n_boot else (None, None)
    return Paired(n, ref_mean, oth_mean, oth_mean - ref_mean, lo, hi,
                  (oth_mean - ref_mean) / ref_mean if ref_mean > 0 else None, rel_lo, rel_hi)


def _percentiles(sorted_xs: list[float]) -> tuple[float, float]:
    k = len(sorted_xs)
    return sorted_xs[int(0.025 * (k - 1))], sorted_xs[math.ceil(0.975 * (k - 1))]
