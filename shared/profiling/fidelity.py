"""The fidelity search: plans ranked by how closely they reproduce the receiver's own full
prefill, then the short list confirmed on the task metric by a sequential test.

Task scores are coarse (a row's exact match is 0 or 1) and tie on small train splits, so a
search that reads their means picks full reuse on ties and "wins" by noise. This search reads
two signals, each where it has power:

  divergence  per row, KL(full prefill || plan) of the receiver's next-token distributions,
              teacher-forced over its own full-prefill answer (`PairScorer.divergences`): a
              continuous number on every row, no generation. It ranks layers (the swap probe:
              only layer l's KV from the sender) and, per group size, the windows; the plans
              that remove at least `kl_share` of full reuse's divergence and beat every smaller
              window (fewest layers first, at most `shortlist`) go on. Under `max_layers` (the
              prefill share a user needs saved) only windows that small are probed; when none of
              them removes `kl_share`, the one that diverges least is raced anyway, flagged, so
              the user hears its task verdict rather than an empty short list.
  task metric full reuse (0 layers), the short list and full prefill scored on the same rows, `batch` rows at a time
              (`race`): after each batch, from `min_rows` on, each plan's paired difference to
              full prefill gets its bootstrap 95 % interval (rows of one document resampled
              together) and the 5 % rule: a plan whose interval is all below it is dropped; once
              a plan is "within", every larger one is dropped (it cannot win: fewer layers do);
              the race ends when the smallest plan left is within, or the rows run out.

The choice is the fewest-layer plan whose interval is within the rule. A plan whose mean meets
the rule but whose interval straddles it is "undecided" and is not chosen; when no plan is
within, the choice is the one with the highest interval floor, reported undecided (or below).
Rows bought by dropping plans early go to the plans still in the race.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from tqdm import tqdm

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import search
from droidmesh.shared.tasks import intervals

RowsOf = Callable[[ReusePlan, int], list[float]]  # (plan, n) -> per-row values of the first n rows


@runtime_checkable
class RowOracle(Protocol):
    """What the fidelity search reads of a train split (`tasks.scorer.PairScorer`)."""

    rows: Sequence[Any]
    documents: Sequence[Hashable]

    def scores(self, plan: ReusePlan, rows: int | None = None) -> list[float]: ...

    def divergences(self, plan: ReusePlan, rows: int | None = None) -> list[float]: ...


@dataclasses.dataclass(frozen=True)
class Settings:
    # rows the divergence ranks plans on: it has power on few rows (every answer token is a
    # sample), and each swap probe is a full prefill
    probe_rows: int = 8
    kl_share: float = 0.5  # a plan goes on when it removes at least this share of full reuse's divergence
    shortlist: int = 4  # at most this many plans (fewest layers first) go to the task metric
    max_layers: int | None = None  # no plan recomputes more layers than this; None: any
    batch: int = 16  # rows added to the race at a time
    min_rows: int = 32  # no verdict before this many rows (a bootstrap on fewer is too narrow)


@dataclasses.dataclass
class Entry:
    """One plan in the race: its verdict on the rows it was scored on."""

    plan: ReusePlan
    layers: int
    rows: int = 0
    verdict: str = "undecided"
    rel: float | None = None
    rel_lo: float | None = None
    rel_hi: float | None = None
    dropped: str | None = None  # why it left the race ("below the rule", "a smaller plan is within")

    def as_json(self) -> dict[str, Any]:
        return {"plan": self.plan.label(), "recomputed_layers": self.layers, "rows": self.rows, "verdict": self.verdict,
                "relative": self.rel, "relative_interval": None if self.rel_lo is None else [self.rel_lo, self.rel_hi],
                "dropped": self.dropped}


@dataclasses.dataclass(frozen=True)
class RaceResult:
    entries: list[Entry]
    chosen: Entry | None  # the fewest-layer plan within the rule; None when none is
    rows: int  # rows the race reached
    row_scores: int  # plan-row task scores it paid for (full prefill's included)


def race(candidates: Sequence[tuple[ReusePlan, int]], scores: RowsOf, total_rows: int,
         groups: Sequence[Hashable] | None, settings: Settings, tolerance: float = intervals.TOLERANCE) -> RaceResult:
    """The sequential test of the module docstring over `candidates` ((plan, recomputed layers)),
    task scores from `scores(plan, n)`, full prefill as the reference, on up to `total_rows` rows."""
    entries = sorted((Entry(p, k) for p, k in candidates), key=lambda e: (e.layers, e.plan.label()))
    full = ReusePlan.full_prefill()
    n = 0
    while entries and n < total_rows:
        alive = [e for e in entries if e.dropped is None]
        if not alive:
            break
        n = min(total_rows, n + settings.batch)
        reference = scores(full, n)
        for e in alive:
            got = scores(e.plan, n)
            _judge(e, reference, got, groups[:n] if groups is not None else None, n >= settings.min_rows, tolerance)
        _drop(entries)
        smallest = next((e for e in entries if e.dropped is None), None)
        if smallest is not None and smallest.verdict == "within":
            break
    within = [e for e in entries if e.verdict == "within"]
    chosen = min(within, key=lambda e: e.layers) if within else None
    return RaceResult(entries, chosen, n, n + sum(e.rows for e in entries))


def _judge(e: Entry, reference: list[float], got: list[float], groups: Sequence[Hashable] | None, decide: bool,
           tolerance: float) -> None:
    p = intervals.paired(reference, got, groups=groups)
    e.rows, e.rel, e.rel_lo, e.rel_hi = len(got), p.rel, p.rel_lo, p.rel_hi
    e.verdict = p.verdict(tolerance) if decide else "undecided"


def _drop(entries: list[Entry]) -> None:
    """Plans that cannot win leave the race: below the rule, or larger than a plan within it."""
    smallest_within = None
    for e in entries:  # fewest layers first
        if e.dropped is not None:
            if e.verdict == "within" and smallest_within is None:
                smallest_within = e
            continue
        if smallest_within is not None:
            e.dropped = "a smaller plan is within the rule"
        elif e.verdict == "below":
            e.dropped = "below the rule"
        elif e.verdict == "within":
            smallest_within = e


def fallback(result: RaceResult) -> Entry | None:
    """When no plan is within the rule: the one with the highest interval floor (undecided or below)."""
    judged = [e for e in result.entries if e.rel_lo is not None]
    return max(judged, key=lambda e: (e.rel_lo or 0.0, -e.layers)) if judged else None


@dataclasses.dataclass(frozen=True)
class Ranked:
    sensitivity: list[float]  # per layer, mean divergence of the swap probe
    full_reuse: float  # mean divergence of full reuse
    windows: list[tuple[int, int, float]]  # per group size, the guided window and its mean divergence
    shortlist: list[tuple[ReusePlan, int]]
    # raced under max_layers though it does not remove kl_share: (plan, its mean divergence)
    short_of_share: list[tuple[ReusePlan, float]] = dataclasses.field(default_factory=list)


def rank(divergence: RowsOf, num_layers: int, g: int, settings: Settings) -> Ranked:
    """The divergence pass on the first `settings.probe_rows` rows: swap probes per layer, then per
    group size on the g grid the window holding the most of their divergence, then the short list:
    windows that remove at least `kl_share` of full reuse's divergence and beat every smaller one."""
    n = settings.probe_rows

    def mean(plan: ReusePlan) -> float:
        xs = divergence(plan, n)
        return sum(xs) / max(1, len(xs))

    sens = [mean(ReusePlan.swap([l])) for l in range(num_layers)]
    reuse = mean(ReusePlan.full_reuse())
    windows = []
    for size in search.group_sizes(num_layers, g, settings.max_layers):
        s, e = search.heaviest_window(sens, num_layers, g, size)
        windows.append((s, e, mean(ReusePlan.recompute(s, e))))
    short: list[tuple[ReusePlan, int]] = []
    best = reuse
    for s, e, kl in windows:  # sizes ascending: the divergence frontier
        if kl < best and kl <= (1.0 - settings.kl_share) * reuse and len(short) < settings.shortlist:
            short.append((ReusePlan.recompute(s, e), e - s))
        best = min(best, kl)
    flagged: list[tuple[ReusePlan, float]] = []
    if not short and settings.max_layers is not None and windows:
        s, e, kl = min(windows, key=lambda w: (w[2], w[1] - w[0]))
        if kl < reuse:  # one that diverges as much as full reuse cannot beat it
            short.append((ReusePlan.recompute(s, e), e - s))
            flagged.append((short[-1][0], kl))
    return Ranked(sens, reuse, windows, short, flagged)


def search_train(train: RowOracle, num_layers: int, g: int, tolerance: float, settings: Settings
                 ) -> tuple[Ranked, RaceResult]:
    """`rank` on `train`'s divergences, then `race` on its task scores, each with a progress bar in rows."""
    probe, sizes = min(settings.probe_rows, len(train.rows)), len(search.group_sizes(num_layers, g, settings.max_layers))
    with tqdm(total=probe * (num_layers + 1 + sizes), desc="divergence", unit="row") as bar:
        ranked = rank(_rows_bar(train.divergences, bar), num_layers, g, settings)
    with tqdm(total=len(train.rows) * (len(ranked.shortlist) + 2), desc="race", unit="row") as bar:
        # full reuse races too, at 0 layers: where it holds, no group is needed (its rows are scored already)
        raced = race([(ReusePlan.full_reuse(), 0), *ranked.shortlist], _rows_bar(train.scores, bar), len(train.rows),
                     train.documents, settings, tolerance)
    return ranked, raced


def _rows_bar(rows_of: Callable[..., list[float]], bar: tqdm) -> RowsOf:
    """`rows_of(plan, rows=n)` that moves `bar` by the rows each call adds (a plan's rows are memoised)."""
    seen: dict[ReusePlan, int] = {}

    def run(plan: ReusePlan, n: int) -> list[float]:
        bar.set_postfix_str(plan.label())
        got = rows_of(plan, rows=n)
        bar.update(max(0, len(got) - seen.get(plan, 0)))
        seen[plan] = max(seen.get(plan, 0), len(got))
        return got
    return run


def section(ranked: Ranked, raced: RaceResult, settings: Settings, rows: int) -> dict[str, Any]:
    """The profile JSON's `fidelity` section."""
    pick = raced.chosen or fallback(raced)
    return {
        "settings": dataclasses.asdict(settings), "probe_rows": min(settings.probe_rows, rows),
        "sensitivity_kl": ranked.sensitivity, "full_reuse_kl": ranked.full_reuse,
        "windows": [{"start": s, "end": e, "recomputed_layers": e - s, "kl": kl} for s, e, kl in ranked.windows],
        "shortlist": [p.label() for p, _ in ranked.shortlist],
        "short_of_kl_share": [{"plan": p.label(), "kl": kl, "share_removed": 1.0 - kl / ranked.full_reuse}
                              for p, kl in ranked.short_of_share],
        "race": [e.as_json() for e in raced.entries], "race_rows": raced.rows, "race_row_scores": raced.row_scores,
        "chosen_verdict": pick.verdict if pick is not None else None, "decided": raced.chosen is not None,
    }
