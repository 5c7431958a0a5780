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
                (after the sensitivity pass's L: the default, linear in L)
  coarse        every group on a grid of ~4 blocks, then the chosen group's ends moved in by
                binary search on the g grid: O(log(L/g)) evaluations (for a tight --budget)
  frontier      best quality per recomputed-layer count; `choose` takes the fewest layers whose
                quality is within `tolerance` of full prefill
"""

from __future__ import annotations

import dataclasses
import math
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


def group_sizes(num_layers: int, g: int, max_layers: int | None = None) -> list[int]:
    """The group sizes on the g grid, ascending (none above `max_layers`)."""
    cuts = grid(num_layers, g)
    sizes = sorted({e - s for i, s in enumerate(cuts[:-1]) for e in cuts[i + 1 :]})
    return [k for k in sizes if max_layers is None or k <= max_layers]


def heaviest_window(weights: list[float], num_layers: int, g: int, size: int) -> tuple[int, int]:
    """The grid window of `size` layers whose `weights` (one per layer) sum highest; the lowest
    start on a tie."""
    cuts = grid(num_layers, g)
    windows = [(s, s + size) for s in cuts[:-1] if s + size in cuts]
    return max(windows, key=lambda w: (sum(weights[w[0] : w[1]]), -w[0]))


def guided(evaluate: Evaluate, sens: list[float], full_prefill: float, num_layers: int, g: int) -> list[Point]:
    """For each group size on the grid, evaluate only the window with the largest summed
    sensitivity loss (reusing those layers hurts most, so recomputing them helps most)."""
    loss = [max(0.0, full_prefill - q) for q in sens]
    points = []
    for size in group_sizes(num_layers, g):
        s, e = heaviest_window(loss, num_layers, g, size)
        points.append(Point(s, e, evaluate(ReusePlan.recompute(s, e))))
    return points


def guided_evaluations(num_layers: int, g: int) -> int:
    """Plans `guided` evaluates: one per group size on the grid."""
    return len(group_sizes(num_layers, g))


COARSE_BLOCKS = 4  # the coarse grid's blocks: at most 10 groups, whatever L is


def coarse_step(num_layers: int, g: int, blocks: int = COARSE_BLOCKS) -> int:
    """The coarse grid's step: a multiple of g (so its cuts are fine-grid cuts) near L / blocks."""
    return g * max(1, math.ceil(num_layers / (blocks * g)))


def coarse_evaluations(num_layers: int, g: int) -> int:
    """At most the plans `coarse` evaluates: every coarse group, then two binary searches."""
    n = len(grid(num_layers, coarse_step(num_layers, g)))
    return n * (n - 1) // 2 + 2 * math.ceil(math.log2(len(grid(num_layers, g))))


def coarse(evaluate: Evaluate, num_layers: int, g: int, full_prefill: float, tolerance: float) -> list[Point]:
    """Coarse to fine: every group on a grid of about COARSE_BLOCKS blocks; then, from the
    fewest-layer one within `tolerance` of full prefill, the start moved as late and then the
    end as early as the group stays within it, each by binary search on the g grid. Binary
    search assumes quality falls as the group shrinks from either end (what the frontier
    expresses); a landscape that is not monotone may hide a smaller group, which `guided`'s
    sensitivity pass would find. Returns every point evaluated (the frontier takes them all)."""
    points = exhaustive(evaluate, num_layers, coarse_step(num_layers, g))
    target = (1.0 - tolerance) * full_prefill
    ok = [p for p in points if p.quality >= target]
    if not ok:  # nothing to refine towards: the frontier's best point is the choice
        return points
    best = min(ok, key=lambda p: (p.layers, -p.quality, p.start))
    cuts = grid(num_layers, g)

    def probe(s: int, e: int) -> bool:
        p = Point(s, e, evaluate(ReusePlan.recompute(s, e)))
        points.append(p)
        return p.quality >= target

    start = _last_ok([c for c in cuts if best.start <= c < best.end], lambda s: probe(s, best.end))
    _last_ok([c for c in reversed(cuts) if start < c <= best.end], lambda e: probe(start, e))
    return points  # the refined group is among them: `best` itself, or a probe that held


def _last_ok(candidates: list[int], ok: Callable[[int], bool]) -> int:
    """The last candidate for which `ok` holds, `ok` assumed true up to some index and false after;
    candidates[0] is known to hold. ceil(log2(len)) probes."""
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(candidates[mid]):
            lo = mid
        else:
            hi = mid - 1
    return candidates[lo]


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
