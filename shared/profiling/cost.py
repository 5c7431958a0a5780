"""What a profile will cost, said before it starts, and the profile that fits a time budget.

The unit is the row-evaluation: one plan scored on one row (a prefill per the plan, then greedy
decoding). `measure` times three on a train row of median length in tokens (`typical_row`;
scaled to the rows' mean length) once the models are loaded, before anything else runs: the
receiver's full prefill (every layer computed), a plan computing one
layer (the rest reused: decoding and little prefill) and the sender's capture of the context.
A plan computing k of L layers is charged in between, by k / L: on a CPU with long contexts
the prefill dominates and a reuse plan costs a fraction of full prefill, on a GPU decoding
dominates and they cost about the same; a single full-prefill timing overstates a search made
of reuse plans by up to 3x on the demo tier. `row_evaluations` counts the plans and rows
(an upper bound: the search's memo only makes it smaller; plans whose group is not known in
advance, such as the chosen one, are charged half the layers; the latency and maps fits are
charged as captures).

A budget (`fit`) cuts the work in the order that loses least: the exhaustive comparison (it only
checks the search), the robustness data sets (a report, not the choice), the guided search for
the coarse-to-fine one (O(log L) plans instead of O(L)), the transfer search (extra coded
frontier points), then rows, scaled down together to no fewer than MIN_ROWS per split. When even
that does not fit, the profile is refused before it starts. `droidmesh profile` fits
an hour unless given another budget or none (`--budget 0`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import fidelity, layer_codecs, search, transfer

UNKNOWN = 0.5  # the share of layers charged to a plan whose group the search has yet to choose
# Below this many rows per split one answer moves the mean by more than 1/8: a budget never cuts
# further (the profile's sample warning still says when the test split is too small to trust).
MIN_ROWS = 8
# Train captures a profile keeps at once (each row's every layer K/V and E); beyond, the least
# recently used is made again when asked (`PairScorer(max_captures=)`).
CAPTURE_BUDGET_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Timing:
    """Measured seconds on one row (`measure`)."""

    full_s: float  # the receiver's full prefill and decoding
    reuse_s: float  # a plan computing one layer and decoding
    capture_s: float  # the sender's prefill of the context, keeping KV and E (no decoding)

    def plan_s(self, share: float) -> float:
        """A plan computing `share` of the receiver's layers: its prefill scales with them."""
        return self.reuse_s + (self.full_s - self.reuse_s) * share

    def scaled(self, factor: float) -> Timing:
        return Timing(self.full_s * factor, self.reuse_s * factor, self.capture_s * factor)

    def describe(self) -> str:
        return (f"measured per row: full prefill {self.full_s:.2f} s, reuse {self.reuse_s:.2f} s, "
                f"sender capture {self.capture_s:.2f} s")


@dataclasses.dataclass(frozen=True)
class Work:
    """What one profile runs: the knobs a budget may turn down."""

    search: str  # "guided" (sensitivity + one window per size: O(L)), "coarse" (O(log L)) or "fidelity"
    exhaustive: bool  # also every grid group, O((L/g)^2), to compare
    n_train: int
    n_test: int
    others: tuple[int, ...] = ()  # rows of each robustness data set
    transfer: bool = False
    max_layers: int | None = None  # the fidelity search probes no window larger

    def describe(self) -> str:
        cap = f" (groups of <= {self.max_layers} layers)" if self.max_layers is not None else ""
        parts = [f"{self.search} search{cap}" + (" + exhaustive" if self.exhaustive else ""),
                 f"{self.n_train} train + {self.n_test} test rows"]
        if self.others:
            parts.append(f"robustness on {len(self.others)} data sets")
        if self.transfer:
            parts.append("transfer search")
        return ", ".join(parts)


def train_plans(work: Work, num_layers: int, g: int) -> list[float]:
    """The share of layers each plan scored on the train split computes: full prefill and full
    reuse, the search, then the chosen group split per layer (and, after a sensitivity pass,
    the critical layers alone)."""
    L = num_layers
    cuts = search.grid(L, g)
    shares = [1.0, 0.0]
    if work.search == "fidelity":  # the race's short list, at most every train row; the chosen split
        shares += [UNKNOWN] * (fidelity.Settings().shortlist + 1)
    elif work.search == "guided":  # a sensitivity probe is the receiver's own prefill: every layer
        shares += [1.0] * L + [k / L for k in search.group_sizes(L, g)] + [UNKNOWN] * 2
    else:
        coarse = search.grid(L, search.coarse_step(L, g))
        shares += [(e - s) / L for i, s in enumerate(coarse[:-1]) for e in coarse[i + 1:]]
        shares += [UNKNOWN] * (search.coarse_evaluations(L, g) - len(coarse) * (len(coarse) - 1) // 2 + 1)
    if work.exhaustive:
        shares += [(e - s) / L for i, s in enumerate(cuts[:-1]) for e in cuts[i + 1:]]
    return shares


def train_evaluations(work: Work, num_layers: int, g: int) -> int:
    """Plans scored on the train split (at most: the memo may find some twice asked)."""
    return len(train_plans(work, num_layers, g))


def transfer_configs(settings: transfer.Settings | None = None) -> int:
    """At most the configs the transfer search scores (`transfer.candidates`, a multi-layer group)."""
    settings = settings or transfer.Settings()
    return 3 + len(settings.shares) + len(settings.patch_shares) + 1 + 1  # the last: the per-layer codec


def _rows(work: Work, num_layers: int, g: int) -> list[tuple[int, float]]:
    """(row-evaluations, seconds each in units a Timing prices) for the whole profile, as
    (count, share) pairs; share -1 marks a capture."""
    test = [1.0, 0.0, UNKNOWN, UNKNOWN] + [UNKNOWN] * (work.search == "guided")  # + the critical layers alone
    out = [(work.n_train, s) for s in train_plans(work, num_layers, g)] + [(work.n_test, s) for s in test]
    if work.search == "fidelity":  # the divergence pass on the probe rows: the reference, swap probes, windows
        probe = min(work.n_train, fidelity.Settings().probe_rows)
        sizes = search.group_sizes(num_layers, g, work.max_layers)
        out += [(probe, 1.0)] * (num_layers + 1) + [(probe, k / num_layers) for k in sizes]
    out += [(work.n_train + work.n_test, -1.0), (work.n_train + work.n_test, 1.0)]  # capture; the sender alone
    for n in work.others:  # capture, full prefill, full reuse, the chosen plan
        out += [(n, -1.0), (n, 1.0), (n, 0.0), (n, UNKNOWN)]
    if work.transfer:  # each config on both splits; the maps fit prefills each train context in both models
        out += [((work.n_train + work.n_test) * transfer_configs(), UNKNOWN), (2 * work.n_train, -1.0)]
        # the per-layer codec's divergence passes on the probe rows (`layer_codecs.choose`, at most)
        probe = min(work.n_train, fidelity.Settings().probe_rows)
        out += [(probe, UNKNOWN)] * (3 + num_layers + len(layer_codecs.SHARES) + len(layer_codecs.THINNER))  # + the reference
    return out


def row_evaluations(work: Work, num_layers: int, g: int) -> tuple[int, int]:
    """(plans on the train split, row-evaluations in all, captures included)."""
    return train_evaluations(work, num_layers, g), sum(n for n, _ in _rows(work, num_layers, g))


def seconds(work: Work, num_layers: int, g: int, timing: Timing) -> float:
    return sum(n * (timing.capture_s if share < 0 else timing.plan_s(share)) for n, share in _rows(work, num_layers, g))


def duration(s: float) -> str:
    """`s` seconds as a person reads a wait: 40 s, 1.1 min, 12 min, 6 h 53 min (a tenth of a
    minute below 10, so a refusal at a 1-minute budget never reads "needs ~1 min")."""
    if s < 60:
        return f"{s:.0f} s"
    if s < 600:
        return f"{s / 60:.1f} min"
    minutes = round(s / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def announce(work: Work, num_layers: int, g: int, timing: Timing) -> str:
    """The line a profile prints before it starts."""
    per_train, total = row_evaluations(work, num_layers, g)
    rest = total - per_train * work.n_train
    probes = "the divergence probes, " if work.search == "fidelity" else ""
    return (f"profile: ~{per_train} evaluations × {work.n_train} rows + {rest} row-evaluations for {probes}the test split, "
            f"the sender{', robustness' if work.others else ''}{', transfer' if work.transfer else ''} "
            f"≈ {duration(seconds(work, num_layers, g, timing))} ({timing.describe()}; {work.describe()})")


def fit(work: Work, num_layers: int, g: int, timing: Timing, budget_s: float) -> tuple[Work, list[str]]:
    """The work to run within `budget_s` and what was cut to get there (empty: nothing).
    BadRequestError when even the cheapest profile would take longer."""

    def cost(w: Work) -> float:
        return seconds(w, num_layers, g, timing)

    steps: list[tuple[str, Callable[[Work], bool], Callable[[Work], Work]]] = [
        ("the exhaustive comparison", lambda w: w.exhaustive, lambda w: dataclasses.replace(w, exhaustive=False)),
        ("the robustness data sets", lambda w: bool(w.others), lambda w: dataclasses.replace(w, others=())),
        ("the guided search (coarse-to-fine instead)", lambda w: w.search == "guided",
         lambda w: dataclasses.replace(w, search="coarse")),
        ("the transfer search", lambda w: w.transfer, lambda w: dataclasses.replace(w, transfer=False)),
    ]
    cut: list[str] = []
    for what, applies, smaller in steps:
        if cost(work) <= budget_s:
            return work, cut
        if applies(work) and cost(smaller(work)) < cost(work):  # coarse is no cheaper on a few layers
            work = smaller(work)
            cut.append(what)
    if cost(work) <= budget_s:
        return work, cut
    # What is left costs rows x a constant per split: scale both row counts by the same factor.
    f = budget_s / cost(work)
    rows = dataclasses.replace(work, n_train=max(min(work.n_train, MIN_ROWS), int(work.n_train * f)),
                               n_test=max(min(work.n_test, MIN_ROWS), int(work.n_test * f)))
    if cost(rows) > budget_s:
        raise BadRequestError(
            f"--budget {budget_s / 60:g} min is too short for any profile of this pair: the cheapest ({rows.describe()}) "
            f"needs ~{duration(cost(rows))} ({timing.describe()}); raise --budget (0: no limit)")
    cut.append(f"rows ({work.n_train} + {work.n_test} -> {rows.n_train} + {rows.n_test})")
    return rows, cut


def typical_row(rows: Sequence[dict[str, Any]], length: Callable[[dict[str, Any]], int]) -> tuple[dict[str, Any], float]:
    """The row to time and the factor from its cost to the rows' mean cost: the row of median
    `length` (its prompt's tokens) and the mean length over its length. A row costs about its
    tokens here (prefill is most of it, and attention a small share of a small model's prefill at
    1-4K tokens), so one long or short row does not skew the whole estimate: real code rows run
    from 763 to 2,772 tokens, and a first row of 2,772 timed 3x the median one."""
    if not rows:
        raise ValueError("no rows to time")
    sizes = [max(1, length(row)) for row in rows]
    mid = sorted(range(len(rows)), key=sizes.__getitem__)[len(rows) // 2]
    return rows[mid], sum(sizes) / len(sizes) / sizes[mid]


def measure(sender: Any, receiver: Any, row: dict[str, Any], spec: Any, repeats: int = 2) -> Timing:
    """Time `row`'s full prefill, its capture by the sender and a one-layer plan: the fastest
    of `repeats` runs each (a shared machine's load only ever slows one down), after a
    discarded one (the first run also pays warm-up: kernels, allocator, caches)."""
    from droidmesh.shared.tasks.scorer import PairScorer

    def timed(scorer: PairScorer, plan: ReusePlan) -> float:
        t0 = time.perf_counter()
        scorer.quality(plan)
        return time.perf_counter() - t0

    timed(PairScorer(sender, receiver, [row], spec), ReusePlan.full_prefill())  # warm-up
    runs = []
    for _ in range(repeats):
        scorer = PairScorer(sender, receiver, [row], spec)  # a fresh one: `quality` is memoised
        with_capture = timed(scorer, ReusePlan.full_reuse())  # the first plan a scorer scores captures the row
        reuse = timed(scorer, ReusePlan.recompute(0, 1))  # the capture kept from here on
        full = timed(scorer, ReusePlan.full_prefill())
        runs.append(Timing(full, min(reuse, full), max(0.0, with_capture - reuse)))
    return Timing(*(min(getattr(t, f.name) for t in runs) for f in dataclasses.fields(Timing)))


def captures_kept(model: Any, rows: Sequence[dict[str, Any]], spec: Any, at_least: int) -> int:
    """How many rows' captures fit CAPTURE_BUDGET_BYTES (never fewer than `at_least`: the fidelity
    search asks rows a batch at a time): every layer's K, V and E at the rows' mean context length
    (~122 MiB a row for the real tier in float32)."""
    from droidmesh.shared.tasks.rows import encode_row

    tokens = sum(len(encode_row(model.tokenizer, r, spec)[0]) for r in rows) / max(1, len(rows))
    k, e = model.kv_shape(1), model.e_shape(1)  # [1, kv heads, 1, head dim], [1, 1, hidden]
    row_bytes = tokens * model.num_layers * (2 * k[1] * k[3] + e[2]) * model.dtype.itemsize
    return max(at_least, int(CAPTURE_BUDGET_BYTES // max(1.0, row_bytes)))
