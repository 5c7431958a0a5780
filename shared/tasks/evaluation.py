"""The eval JSON (`droidmesh eval`): every reuse path of a pair on one task, and the DroidSpeak
phenomena as numbers.

Paths, all scored by `PairScorer.paths`:
  sender_alone           the sender answers by itself (full prefill)
  receiver_full_prefill  the receiver computes everything (the reference)
  receiver_full_reuse    every context layer's KV from the sender
  per_layer_reuse[l]     only layer l's KV from the sender: groups [0,l) and [l+1,L) recomputed
  groups[(s,e)]          recompute the contiguous group [s,e) from the sender's E_s, reuse the rest
  coded[path@wire]       full reuse or a group with its reused tensors sent under a codec (`wires`),
                         also against the same plan sent raw (`vs_raw`, `rows_changed`)
Per path: `quality` (task score in [0, 1]), `answer_nll`, and its fidelity to the receiver's full
prefill: `kl` / `top1_agreement` of the next-token distributions (teacher-forced over the gold
answer) and `greedy_agreement` (the share of full prefill's greedy answer tokens it reproduces),
each a mean over rows; and `vs_full_prefill`: the paired difference of its task scores to the
receiver's full prefill on the same rows, relative, with a bootstrap 95 % interval (a document's
rows resampled together) and the 5 % rule applied to it (`intervals.Paired.verdict`: within,
below or undecided); where rows name their source file, `vs_full_prefill_by_source` resamples
whole sources instead (rows cut from one module are not independent beyond a document).

With `keep_rows`, the JSON also holds every row's figures (`per_row`), so an eval run in shards
(disjoint slices of one row list, one process each) is `merge`d into the eval of all its rows:
the rows are put back in their original order, so the merged intervals are the unsharded ones.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.tasks import intervals, measures
from droidmesh.shared.tasks.scorer import PairScorer, PathResult, Wire, per_layer_plan
from droidmesh.shared.tasks.spec import TaskSpec

CRITICAL_DROP = 0.05  # a layer is critical when reusing only it costs > 5% of full-prefill quality
FIGURES = ("quality", "answer_nll", "kl", "top1_agreement", "greedy_agreement")  # per row and path
# shards share these; a --data file by its bytes, not its path (shards may run from other directories)
SAME_EVAL = ("task", "metric", "total_layers", "sender", "receiver", "split", "data_sha256", "dtype")
NAMED_PATHS = ("sender_alone", "receiver_full_prefill", "receiver_full_reuse")
PATH_NAME = re.compile(r"layer/\d+|group/\d+/\d+(@[a-z0-9-]+)?|receiver_full_reuse@[a-z0-9-]+")  # @: a wire
WIRE_NAME = re.compile(r"[a-z0-9-]+")


@dataclasses.dataclass(frozen=True)
class RowsMeta:
    """Who each row is: its index in the full row list, id, document and source file (or None)."""

    index: list[int]
    ids: list[Any]
    documents: list[str]
    sources: list[str | None]


def all_groups(num_layers: int, sizes: Sequence[int] | None = None, stride: int = 1) -> list[tuple[int, int]]:
    """Contiguous groups of each size, starting every `stride` layers (the last start always
    included, so the top of the stack is covered): a 30-layer model on a CPU cannot afford all."""
    sizes = sizes or range(1, num_layers + 1)
    out = []
    for k in sizes:
        starts = list(range(0, num_layers - k + 1, stride))
        if starts and starts[-1] != num_layers - k:
            starts.append(num_layers - k)
        out += [(s, s + k) for s in starts]
    return out


class _Acc:
    """Running means of quality / NLL / KL / top-1 for one path."""

    def __init__(self) -> None:
        self.q: list[float] = []
        self.nll: list[float] = []
        self.kl: list[float] = []
        self.top1: list[float] = []
        self.greedy: list[float] = []

    def lists(self) -> tuple[list[float], ...]:  # in FIGURES' order
        return self.q, self.nll, self.kl, self.top1, self.greedy

    def add(self, r: PathResult, ref: PathResult) -> None:
        self.q.append(r.quality)
        self.nll.append(r.nll)
        self.kl.append(measures.kl_divergence(ref.logits, r.logits))
        self.top1.append(measures.top1_agreement(ref.logits, r.logits))
        self.greedy.append(measures.greedy_agreement(ref.tokens, r.tokens))

    def summary(self, reference: _Acc | None = None, documents: Sequence[str] | None = None,
                sources: Sequence[str | None] | None = None) -> dict[str, Any]:
        """Means over rows; with `reference` (full prefill's accumulator on the same rows), the
        paired interval against it, resampling documents and (where every row names one) sources."""
        def mean(xs):
            return round(sum(xs) / max(1, len(xs)), 4)
        out: dict[str, Any] = {"quality": mean(self.q), "answer_nll": mean(self.nll), "kl": mean(self.kl),
                               "top1_agreement": mean(self.top1), "greedy_agreement": mean(self.greedy)}
        if reference is not None and self.q:
            p = intervals.paired(reference.q, self.q, n_boot=2000, groups=documents)
            out["vs_full_prefill"] = intervals.versus_json(p)
            if sources is not None and all(sources):
                by_source = intervals.paired(reference.q, self.q, n_boot=2000, groups=sources)
                out["vs_full_prefill_by_source"] = intervals.versus_json(by_source)
        return out


def evaluate_pair(
    sender: ModelAdapter,
    receiver: ModelAdapter,
    rows: Sequence[dict[str, Any]],
    spec: TaskSpec,
    *,
    group_sizes: Sequence[int] | None = None,
    group_stride: int = 1,
    layer_stride: int = 1,
    groups: Sequence[tuple[int, int]] | None = None,
    sender_alone: bool = True,
    progress: bool = True,
    keep_predictions: bool = False,
    keep_rows: bool = False,
    row_index: Sequence[int] | None = None,
    wires: Mapping[str, Callable[[ReusePlan], Wire]] | None = None,
) -> dict[str, Any]:
    """The eval JSON for (sender, receiver) on `rows` (see the module docstring); per-layer probes
    every `layer_stride` layers (0: none), groups starting every `group_stride` layers, or exactly
    `groups`; `sender_alone=False` skips that path; `row_index`: each row's place in the full row
    list when `rows` is a shard of it (kept with `keep_rows`); `wires`: name -> the wire a plan's
    reused tensors travel under, each scored as one more path per group and for full reuse
    ("group/6/9@int8"), beside the same plan sent raw."""
    L = receiver.num_layers
    plans: dict[str, ReusePlan] = {"receiver_full_reuse": ReusePlan.full_reuse()}
    for l in range(0, L, layer_stride) if layer_stride > 0 else ():
        plans[f"layer/{l}"] = per_layer_plan(l, L)
    for s, e in groups if groups is not None else all_groups(L, group_sizes, group_stride):
        plans[f"group/{s}/{e}"] = ReusePlan.recompute(s, e)
    coded: dict[str, Wire] = {}
    reused = [n for n in plans if not n.startswith("layer/")]  # full reuse and the groups
    for wire_name, wire_of in (wires or {}).items():
        if not WIRE_NAME.fullmatch(wire_name):
            raise ValueError(f"a wire's name is lowercase letters, digits and '-', not {wire_name!r}")
        for name in reused:
            plans[f"{name}@{wire_name}"] = plans[name]
            coded[f"{name}@{wire_name}"] = wire_of(plans[name])
    scorer = PairScorer(sender, receiver, rows, spec)
    acc = {k: _Acc() for k in ["sender_alone", "receiver_full_prefill", *plans] if sender_alone or k != "sender_alone"}
    preds: list[dict[str, Any]] = []
    for row_id, res in zip(scorer.ids, scorer.paths(plans, progress=progress, sender_alone=sender_alone, wires=coded),
                           strict=True):
        ref = res["receiver_full_prefill"]
        for name, r in res.items():
            acc[name].add(r, ref)
        preds.append({"_id": row_id, **{k: res[k].prediction for k in
                                        ("receiver_full_prefill", "sender_alone", "receiver_full_reuse") if k in res}})
    meta = RowsMeta(list(row_index if row_index is not None else range(len(rows))), list(scorer.ids),
                    list(scorer.documents), [r.get("source_file") for r in rows])
    ev = report(acc, L, spec.name, spec.metric, preds if keep_predictions else None, meta)
    if keep_rows:
        ev["per_row"] = _per_row(meta, acc)
    return ev


def merge(parts: Sequence[dict[str, Any]], *, incomplete_ok: bool = False) -> dict[str, Any]:
    """The eval of all the rows of `parts` (shards of one eval, each with `per_row`): a
    ValueError for a part that is not such an eval, shards of different pairs, tasks, splits,
    dtypes or paths, a row in two shards, or (unless `incomplete_ok`, and then the result says
    `incomplete`) shards that do not cover their row list."""
    if not parts:
        raise ValueError("no evals to merge")
    for p in parts:
        check_part(p)
    first = parts[0]
    same = SAME_EVAL if all("data_sha256" in p for p in parts) else (*SAME_EVAL, "data")  # older files: by path
    for p in parts:
        differ = [k for k in same if p.get(k) != first.get(k)]
        if differ or set(p["per_row"]["paths"]) != set(first["per_row"]["paths"]):
            raise ValueError(f"the evals differ in {differ or ['their paths']}: not shards of one eval")
    rows = sorted((idx, n, j) for n, p in enumerate(parts) for j, idx in enumerate(p["per_row"]["index"]))
    if len({r[0] for r in rows}) != len(rows):
        raise ValueError("a row is in more than one shard")
    of = {p["per_row"].get("of") for p in parts}
    total = of.pop() if len(of) == 1 else None
    complete = total is not None and [r[0] for r in rows] == list(range(total))
    if not complete and not incomplete_ok:
        raise ValueError(f"the shards hold {len(rows)} rows of {'a list of unknown length' if total is None else total}"
                         " (--incomplete merges what is there)")
    meta = RowsMeta(index=[r[0] for r in rows], **{f: [parts[n]["per_row"][f][j] for _, n, j in rows]
                                                   for f in ("ids", "documents", "sources")})
    acc = {name: _Acc() for name in first["per_row"]["paths"]}
    for name, a in acc.items():
        for f, dest in zip(FIGURES, a.lists(), strict=True):
            dest.extend(parts[n]["per_row"]["paths"][name][f][j] for _, n, j in rows)
    kept = all(isinstance(p.get("predictions"), list) and len(p["predictions"]) == len(p["per_row"]["index"])
               and all(isinstance(x, dict) for x in p["predictions"]) for p in parts)  # every shard ran --predictions
    preds = [parts[n]["predictions"][j] for _, n, j in rows] if kept else None
    ev = report(acc, first["total_layers"], first["task"], first["metric"], preds, meta)
    ev["per_row"] = {**_per_row(meta, acc), "of": total}
    ev.update({k: first.get(k) for k in (*SAME_EVAL, "data") if k in first})
    if not complete:
        ev["incomplete"] = {"rows": len(rows), "of": total}
    return ev


def check_part(p: Any) -> None:
    """A shard as `merge` needs it, checked before anything is read from it (files are the user's)."""
    pr = p.get("per_row") if isinstance(p, dict) else None
    if not isinstance(pr, dict):
        raise ValueError("not an eval with per-row figures: run each shard with --shard or --per-row")
    index, paths = pr.get("index"), pr.get("paths")
    if not isinstance(index, list) or not index or not all(type(i) is int and i >= 0 for i in index):
        raise ValueError("per_row.index: row numbers (integers >= 0) expected")
    n = len(index)
    if any(not isinstance(pr.get(f), list) or len(pr[f]) != n for f in ("ids", "documents", "sources")):
        raise ValueError(f"per_row: ids, documents and sources must each list the {n} rows")
    if not isinstance(p.get("total_layers"), int) or p["total_layers"] < 1 or not isinstance(paths, dict) or \
            not {"receiver_full_prefill", "receiver_full_reuse"} <= set(paths):
        raise ValueError("not an eval: total_layers and the full prefill and full reuse paths expected")
    for name, figures in paths.items():
        if name not in NAMED_PATHS and not PATH_NAME.fullmatch(str(name)):
            raise ValueError(f"unknown path {name!r}")
        for f in FIGURES:
            vals = figures.get(f) if isinstance(figures, dict) else None
            if not isinstance(vals, list) or len(vals) != n or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
                raise ValueError(f"path {name}: {f} must be {n} finite numbers")
        if not all(0.0 <= v <= 1.0 for v in figures["quality"]):
            raise ValueError(f"path {name}: a quality outside [0, 1]")


def _per_row(meta: RowsMeta, acc: dict[str, _Acc]) -> dict[str, Any]:
    return {**dataclasses.asdict(meta), "paths": {k: dict(zip(FIGURES, a.lists(), strict=True)) for k, a in acc.items()}}


def report(acc: dict[str, _Acc], L: int, task: str, metric: str, preds: list[dict[str, Any]] | None,
           meta: RowsMeta | None = None) -> dict[str, Any]:
    ref = acc["receiver_full_prefill"]
    documents, sources = (meta.documents, meta.sources) if meta is not None else (None, None)
    n = len(ref.q)
    s = {k: a.summary(None if k == "receiver_full_prefill" else ref, documents, sources) for k, a in acc.items()}
    per_layer = [{"layer": l, **s[f"layer/{l}"]} for l in range(L) if f"layer/{l}" in s]
    groups = [
        {"start": int(k.split("/")[1]), "end": int(k.split("/")[2]),
         "recomputed_layers": int(k.split("/")[2]) - int(k.split("/")[1]), **v}
        for k, v in s.items() if k.startswith("group/") and "@" not in k
    ]
    best = []
    for size in sorted({g["recomputed_layers"] for g in groups}):
        cands = [g for g in groups if g["recomputed_layers"] == size]
        best.append(max(cands, key=lambda g: (g["quality"], -g["answer_nll"], -g["start"])))
    out = {
        "task": task, "metric": metric, "rows": n, "total_layers": L,
        "sender_alone": s.get("sender_alone"), "receiver_full_prefill": s["receiver_full_prefill"],
        "receiver_full_reuse": s["receiver_full_reuse"], "per_layer_reuse": per_layer,
        "best_groups": best, "groups": groups, "documents": len(set(documents)) if documents is not None else n,
    }
    if sources is not None and all(sources):
        out["sources"] = len(set(sources))
    out["coded"] = [_coded(k, s[k], acc, documents) for k in s if "@" in k]
    out["summary"] = must_show(out)
    if preds is not None:
        out["predictions"] = preds
    return out


def _coded(name: str, summary: dict[str, Any], acc: dict[str, _Acc], documents: Sequence[str] | None
           ) -> dict[str, Any]:
    """A plan under a wire: its figures, and against the same plan sent raw on the same rows (the
    codec's own cost: a paired interval by document, and the rows whose score it changes)."""
    path, wire = name.split("@")
    raw, got = acc[path].q, acc[name].q
    return {"path": path, "wire": wire, **summary,
            "vs_raw": intervals.versus_json(intervals.paired(raw, got, n_boot=2000, groups=documents)),
            "rows_changed": sum(abs(a - b) > 1e-9 for a, b in zip(raw, got, strict=True))}


def must_show(ev: dict[str, Any], drop: float = CRITICAL_DROP) -> dict[str, Any]:
    """The DroidSpeak phenomena as numbers: relative full-reuse loss, critical layers (reusing
    only that layer costs > `drop` of full-prefill quality), and the smallest contiguous group
    restoring quality to within 5% of full prefill."""
    fp = ev["receiver_full_prefill"]["quality"]
    L = ev["total_layers"]
    def rel(q):
        return (fp - q) / fp if fp > 0 else 0.0
    critical = [p["layer"] for p in ev["per_layer_reuse"] if rel(p["quality"]) > drop]
    restoring = [g for g in ev["best_groups"] if rel(g["quality"]) <= 0.05]
    smallest = min(restoring, key=lambda g: g["recomputed_layers"]) if restoring else None
    return {
        "full_reuse_relative_loss": round(rel(ev["receiver_full_reuse"]["quality"]), 4),
        "full_reuse_above_sender": None if ev["sender_alone"] is None
        else ev["receiver_full_reuse"]["quality"] > ev["sender_alone"]["quality"],
        "critical_layers": critical,
        "critical_fraction": round(len(critical) / L, 4),
        "smallest_restoring_group": None if smallest is None else {
            "start": smallest["start"], "end": smallest["end"], "fraction": round(smallest["recomputed_layers"] / L, 4),
            "relative_loss": round(rel(smallest["quality"]), 4)},
        "critical_threshold": drop,
    }
