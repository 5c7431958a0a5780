"""Pair evaluation: how much of a receiver's quality survives reusing a sender's KV cache.

For every row the sender prefills the context once (capturing KV and the E cache at every
layer); the receiver then answers through each reuse path:
  sender_alone           the sender answers by itself (full prefill)
  receiver_full_prefill  the receiver computes everything (the reference)
  receiver_full_reuse    every context layer's KV from the sender
  per_layer_reuse[l]     only layer l's KV from the sender: groups [0,l) and [l+1,L) recomputed
  groups[(s,e)]          recompute the contiguous group [s,e) from the sender's E_s, reuse the rest
Per path: the task score (`quality`, in [0, 1]), the gold answer's mean NLL, and the KL /
top-1 agreement of its next-token distributions against the receiver's full prefill over the
same positions (question + teacher-forced answer tokens).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from shared.kv.capture import capture_prefill
from shared.kv.plan import ReusePlan
from shared.kv.sources import CapturedSource
from shared.kv.partial import prefill
from shared.model.adapter import ModelAdapter
from shared.zoo import metrics as M
from shared.zoo.suite import TaskSpec, decode_answer, encode_row

CRITICAL_DROP = 0.05  # a layer is critical when reusing only it costs > 5% of full-prefill quality


@dataclasses.dataclass
class PathResult:
    """One path on one row: score, gold NLL, and the logits used for fidelity [P, vocab]."""

    prediction: str
    quality: float
    nll: float
    logits: torch.Tensor


def per_layer_plan(layer: int, num_layers: int) -> ReusePlan:
    """Reuse only `layer`: recompute everything below and above it."""
    groups = [(s, e) for s, e in ((0, layer), (layer + 1, num_layers)) if e > s]
    return ReusePlan.recompute_groups(groups)


def all_groups(num_layers: int, sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    sizes = sizes or range(1, num_layers + 1)
    return [(s, s + k) for k in sizes for s in range(0, num_layers - k + 1)]


def _greedy(model: ModelAdapter, cache: Any, first: int, past: int, n: int, eos: int | None) -> list[int]:
    tokens, token = [first], first
    while len(tokens) < n and token != eos:
        h = model.run_layers(model.embed(torch.tensor([[token]])), 0, model.num_layers, cache, past=past)
        token = int(model.logits(h)[0, -1].argmax())
        tokens.append(token)
        past += 1
    return tokens


def run_path(model: ModelAdapter, prompt: list[int], answer: list[int], plan: ReusePlan, source: Any,
             spec: TaskSpec, gold: list[str], suffix: int) -> PathResult:
    """Prefill `prompt` per `plan`, then (a) teacher-force the gold answer for its NLL and
    fidelity logits, (b) greedy-decode on a copy of the cache for the task score.
    Returns logits [suffix + len(answer) - 1, vocab]: the last `suffix` prompt positions
    (the ones every path computes) plus the answer positions."""
    pre = prefill(model, prompt, plan, source)
    eos = getattr(model.tokenizer, "eos_token_id", None) if model.tokenizer is not None else None
    gen_cache = copy.deepcopy(pre.cache)
    first = int(pre.logits[-1].argmax())
    ans_logits = pre.logits[-1:]  # [1, vocab] predicts answer[0]
    if len(answer) > 1:
        h = model.run_layers(model.embed(torch.tensor([answer[:-1]])), 0, model.num_layers, pre.cache, past=len(prompt))
        ans_logits = torch.cat([ans_logits, model.logits(h)[0]])  # [A, vocab]
    nll = M.answer_nll(ans_logits, answer)
    tokens = _greedy(model, gen_cache, first, len(prompt), spec.max_new_tokens, eos)
    pred = decode_answer(model.tokenizer, tokens, spec)
    logits = torch.cat([pre.logits[-suffix:], ans_logits[1:]])
    return PathResult(pred, M.score(spec.metric, pred, gold), nll, logits)


class _Acc:
    """Running means of quality / NLL / KL / top-1 for one path."""

    def __init__(self) -> None:
        self.q: list[float] = []
        self.nll: list[float] = []
        self.kl: list[float] = []
        self.top1: list[float] = []

    def add(self, r: PathResult, ref: PathResult) -> None:
        self.q.append(r.quality)
        self.nll.append(r.nll)
        self.kl.append(M.kl_divergence(ref.logits, r.logits))
        self.top1.append(M.top1_agreement(ref.logits, r.logits))

    def summary(self) -> dict[str, float]:
        mean = lambda xs: round(sum(xs) / max(1, len(xs)), 4)
        return {"quality": mean(self.q), "answer_nll": mean(self.nll), "kl": mean(self.kl), "top1_agreement": mean(self.top1)}


@torch.inference_mode()
def evaluate_pair(
    sender: ModelAdapter,
    receiver: ModelAdapter,
    rows: Sequence[dict[str, Any]],
    spec: TaskSpec,
    *,
    group_sizes: Sequence[int] | None = None,
    progress: bool = True,
    keep_predictions: bool = False,
) -> dict[str, Any]:
    """The eval JSON for (sender, receiver) on `rows` (see the module docstring)."""
    L = receiver.num_layers
    plans: dict[str, ReusePlan] = {"receiver_full_reuse": ReusePlan.full_reuse()}
    for l in range(L):
        plans[f"layer/{l}"] = per_layer_plan(l, L)
    for s, e in all_groups(L, group_sizes):
        plans[f"group/{s}/{e}"] = ReusePlan.recompute(s, e)
    acc = {k: _Acc() for k in ["sender_alone", "receiver_full_prefill", *plans]}
    preds: list[dict[str, Any]] = []
    bar = tqdm(rows, desc=f"eval {spec.name}", unit="row", disable=not progress)
    for row in bar:
        ctx, q, ans = encode_row(receiver.tokenizer, row, spec)
        prompt = ctx + q
        suffix = len(prompt) - min(len(ctx), len(prompt) - 1)  # tokens every path computes
        source = CapturedSource(capture_prefill(sender, ctx, e_layers=range(L)))
        ref = run_path(receiver, prompt, ans, ReusePlan.full_prefill(), None, spec, row["answers"], suffix)
        acc["receiver_full_prefill"].add(ref, ref)
        alone = run_path(sender, prompt, ans, ReusePlan.full_prefill(), None, spec, row["answers"], suffix)
        acc["sender_alone"].add(alone, ref)
        row_preds = {"_id": row.get("_id"), "receiver_full_prefill": ref.prediction, "sender_alone": alone.prediction}
        for name, plan in plans.items():
            r = run_path(receiver, prompt, ans, plan, source, spec, row["answers"], suffix)
            acc[name].add(r, ref)
            if name == "receiver_full_reuse":
                row_preds[name] = r.prediction
        preds.append(row_preds)
    return report(acc, L, spec, len(rows), preds if keep_predictions else None)


def report(acc: dict[str, _Acc], L: int, spec: TaskSpec, n: int, preds: list[dict[str, Any]] | None) -> dict[str, Any]:
    s = {k: a.summary() for k, a in acc.items()}
    per_layer = [{"layer": l, **s[f"layer/{l}"]} for l in range(L)]
    groups = [
        {"start": int(k.split("/")[1]), "end": int(k.split("/")[2]),
         "recomputed_layers": int(k.split("/")[2]) - int(k.split("/")[1]), **v}
        for k, v in s.items() if k.startswith("group/")
    ]
    best = []
    for size in sorted({g["recomputed_layers"] for g in groups}):
        cands = [g for g in groups if g["recomputed_layers"] == size]
        best.append(max(cands, key=lambda g: (g["quality"], -g["answer_nll"], -g["start"])))
    out = {
        "task": spec.name, "metric": spec.metric, "rows": n, "total_layers": L,
        "sender_alone": s["sender_alone"], "receiver_full_prefill": s["receiver_full_prefill"],
        "receiver_full_reuse": s["receiver_full_reuse"], "per_layer_reuse": per_layer,
        "best_groups": best, "groups": groups,
    }
    out["summary"] = must_show(out)
    if preds is not None:
        out["predictions"] = preds
    return out


def must_show(ev: dict[str, Any], drop: float = CRITICAL_DROP) -> dict[str, Any]:
    """The DroidSpeak phenomena as numbers: relative full-reuse loss, critical layers (reusing
    only that layer costs > `drop` of full-prefill quality), and the smallest contiguous group
    restoring quality to within 5% of full prefill."""
    fp = ev["receiver_full_prefill"]["quality"]
    L = ev["total_layers"]
    rel = lambda q: (fp - q) / fp if fp > 0 else 0.0
    critical = [p["layer"] for p in ev["per_layer_reuse"] if rel(p["quality"]) > drop]
    restoring = [g for g in ev["best_groups"] if rel(g["quality"]) <= 0.05]
    smallest = min(restoring, key=lambda g: g["recomputed_layers"]) if restoring else None
    return {
        "full_reuse_relative_loss": round(rel(ev["receiver_full_reuse"]["quality"]), 4),
        "full_reuse_above_sender": ev["receiver_full_reuse"]["quality"] > ev["sender_alone"]["quality"],
        "critical_layers": critical,
        "critical_fraction": round(len(critical) / L, 4),
        "smallest_restoring_group": None if smallest is None else {
            "start": smallest["start"], "end": smallest["end"], "fraction": round(smallest["recomputed_layers"] / L, 4),
            "relative_loss": round(rel(smallest["quality"]), 4)},
        "critical_threshold": drop,
    }
