"""Offline search for a pair's recompute group (a contiguous group of layers recomputed from the sender's E), over any quality oracle.

`evaluate(plan) -> quality in [0, 1]` is the only thing the search needs (the profiler backs it
with the receiver's task score on a train split). Memoised: a plan is never evaluated twice, and
`evaluations` counts distinct plans, which is what each search strategy is charged.

  sensitivity   quality when only layer l's KV is the sender's and every other layer the
                receiver's own (the swap probe, DroidSpeak Fig. 7: no E enters, so it shows
                which layers' KV the receiver reads; E deviation is what groups then pay for)
  critical      layers whose reuse alone drops quality by more than `threshold` x full prefill
  exhaustive    every group [s, e) on a granularity-g grid: O((L/g)^2) evaluations
  guided        per size k, only the window [s, s+k) holding the most sensitivity loss: O(L/g)
  frontier      best quality per recomputed-layer count; `choose` takes the fewest layers whose
                quality is within `tolerance` of full prefill
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from droidmesh.shared.kv.plan import ReusePlan

Evaluate = Callable[[ReusePlan], float]


@dataclasses.dataclass(frozen=True)
class Point:
    start: int
    end: int  # recompute [start, end); start == end: full reuse
    quality: float

    @property
    def layers(self) -> int:
        return self.end - self.start

    def plan(self) -> ReusePlan:
        return ReusePlan.recompute(self.start, self.end) if self.end > self.start else ReusePlan.full_reuse()


class Memo:
    """Memoising wrapper; `seen` is the number of distinct plans evaluated."""

    def __init__(self, evaluate: Evaluate):
        self._evaluate = evaluate
        self._cache: dict[ReusePlan, float] = {}

    def __call__(self, plan: ReusePlan) -> float:
        if plan not in self._cache:
            self._cache[plan] = float(self._evaluate(plan))
        return self._cache[plan]

    @property
    def seen(self) -> int:
        return len(self._cache)


def sensitivity(evaluate: Evaluate, num_layers: int) -> list[float]:
    """quality[l] with only layer l's KV taken from the sender."""
    return [evaluate(ReusePlan.swap([l])) for l in range(num_layers)]


def critical_layers(sens: list[float], full_prefill: float, threshold: float) -> list[int]:
    return [l for l, q in enumerate(sens) if full_prefill - q > threshold * max(full_prefill, 1e-9)]


def grid(num_layers: int, g: int) -> list[int]:
    """Group boundaries on a granularity-g grid, always including L."""
    return sorted(set(range(0, num_layers, g)) | {num_layers})


def exhaustive(evaluate: Evaluate, num_layers: int, g: int) -> list[Point]:
    cuts = grid(num_layers, g)
    return [Point(s, e, evaluate(ReusePlan.recompute(s, e))) for i, s in enumerate(cuts[:-1]) for e in cuts[i + 1 :]]


def guided(evaluate: Evaluate, sens: list[float], full_prefill: float, num_layers: int, g: int) -> list[Point]:
    """For each group size on the grid, evaluate only the window with the largest summed
    sensitivity loss (reusing those layers hurts most, so recomputing them helps most)."""
    loss = [max(0.0, full_prefill - q) for q in sens]
    cuts = grid(num_layers, g)
    points = []
    for size in sorted({e - s for i, s in enumerate(cuts[:-1]) for e in cuts[i + 1 :]}):
        windows = [(s, s + size) for s in cuts[:-1] if s + size in cuts]
        s, e = max(windows, key=lambda w: (sum(loss[w[0] : w[1]]), -w[0]))
        points.append(Point(s, e, evaluate(ReusePlan.recompute(s, e))))
    return points


def frontier(points: list[Point], full_reuse: float) -> list[Point]:
    """Best point per recomputed-layer count (ties: earliest start), plus full reuse at 0 layers,
    keeping only points that beat every cheaper one (the Pareto frontier)."""
    best: dict[int, Point] = {0: Point(0, 0, full_reuse)}
    for p in points:
        cur = best.get(p.layers)
        if cur is None or p.quality > cur.quality or (p.quality == cur.quality and p.start < cur.start):
            best[p.layers] = p
    out, top = [], float("-inf")
    for k in sorted(best):
        if best[k].quality > top:
            out.append(best[k])
            top = best[k].quality
    return out


def choose(front: list[Point], full_prefill: float, tolerance: float) -> Point:
    """Fewest recomputed layers within `tolerance` of full prefill (else the best point)."""
    target = (1.0 - tolerance) * full_prefill
    ok = [p for p in front if p.quality >= target]
    return min(ok, key=lambda p: p.layers) if ok else max(front, key=lambda p: p.quality)


def scattered(critical: list[int]) -> ReusePlan:
    """Recompute only the critical layers: one group per run of adjacent critical layers, each
    starting from its own sender E (each start of a group injects the sender's deviation, so scattered groups cost quality)."""
    groups: list[tuple[int, int]] = []
    for l in critical:
        if groups and groups[-1][1] == l:
            groups[-1] = (groups[-1][0], l + 1)
        else:
            groups.append((l, l + 1))
    return ReusePlan.recompute_groups(groups)


def split(start: int, end: int) -> ReusePlan:
    """The group [start, end) recomputed as one-layer groups, each from its own sender E: the
    same compute, more transitions (each one injects the sender's deviation)."""
    return ReusePlan.recompute_groups((l, l + 1) for l in range(start, end))
