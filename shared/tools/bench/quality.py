"""`droidmesh bench quality`: receiver TTFT vs quality per path (full prefill, full reuse,
CacheBlend-style selective recompute, DroidMesh groups), one pair.

Quality: the task metric on the test split through each path (`PairScorer`, the one scorer). TTFT: the
receiver's compute for that path in process (the sender's cache already local; transfer costs
are the pipeline / bandwidth suites' business), at the rows' context length and at a 4K-token
context. `speedup_at_5pct` = full prefill TTFT / TTFT of the cheapest DroidMesh group whose
test quality is within 5% of full prefill, at 4K tokens.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared import report
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.tasks.scorer import PairScorer

BLEND_RATIOS = (0.1, 0.2, 0.4, 0.6)


def ttft(model: ModelAdapter, sender: ModelAdapter, tokens: int, plan: ReusePlan, repeats: int = 3) -> float:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, model.config.vocab_size, (tokens + 8,), generator=g).tolist()
    src = CapturedSource(capture_prefill(sender, ids[:tokens], e_layers=plan.e_layers))
    runs = [generate(model, ids, plan, src, max_new_tokens=1).ttft_s for _ in range(repeats + 1)]
    return statistics.median(runs[1:])


def plans(num_layers: int, frontier: list[dict[str, Any]] | None) -> list[tuple[str, ReusePlan]]:
    out = [("full prefill", ReusePlan.full_prefill()), ("full reuse", ReusePlan.full_reuse())]
    out += [(f"cacheblend {r:.0%}", ReusePlan.cacheblend(r)) for r in BLEND_RATIOS]
    groups = [(p["start"], p["end"]) for p in frontier or [] if p["end"] > p["start"]]
    groups = groups or [(0, k) for k in range(1, num_layers)]
    out += [(f"droidmesh [{s},{e})", ReusePlan.recompute(s, e)) for s, e in groups]
    return out


def measure(sender: ModelAdapter, receiver: ModelAdapter, evaluator: PairScorer,
            frontier: list[dict[str, Any]] | None, long_tokens: int = 4096, tolerance: float = 0.05,
            repeats: int = 3) -> dict[str, Any]:
    L = receiver.num_layers
    ctx_tokens = round(statistics.fmean(len(r.context) for r in evaluator.rows))
    rows = []
    for name, plan in tqdm(plans(L, frontier), desc="quality", unit="config"):
        rows.append({"config": name, "mode": plan.mode, "recomputed_layers": len(plan.recomputed_layers(L)),
                     "quality": evaluator.quality(plan), "ttft_s": ttft(receiver, sender, ctx_tokens, plan, repeats),
                     "ttft_4k_s": ttft(receiver, sender, long_tokens, plan, repeats), "plan": plan.to_dict()})
    full = rows[0]
    for r in rows:
        r["speedup"] = full["ttft_s"] / r["ttft_s"]
        r["speedup_4k"] = full["ttft_4k_s"] / r["ttft_4k_s"]
    ok = [r for r in rows if r["mode"] == "groups" and r["quality"] >= (1 - tolerance) * full["quality"]]
    best = min(ok, key=lambda r: r["ttft_4k_s"]) if ok else None
    return {"total_layers": L, "context_tokens": ctx_tokens, "long_tokens": long_tokens, "repeats": repeats, "rows": rows,
            "sender_alone": evaluator.sender_alone(), "chosen": best["config"] if best else None,
            "speedup_at_5pct": best["speedup_4k"] if best else None}


def plot(result: dict[str, Any], path: str, title: str) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, marker, label in (("full_prefill", "s", "full prefill"), ("full_reuse", "v", "full reuse"),
                                ("cacheblend", "^", "CacheBlend x-model"), ("groups", "o", "DroidMesh group")):
        rs = [r for r in result["rows"] if r["mode"] == mode]
        xs, ys = [r["ttft_s"] * 1e3 for r in rs], [r["quality"] for r in rs]
        ax.scatter(xs, ys, marker=marker, s=40, label=label)
        report.label_points(ax, xs, ys, "{:.2f}")  # a quality of 0 reads as a value, not a missing point
    ax.axhline(result["sender_alone"], c="0.5", ls=":", label="sender alone")
    ax.set_xlabel(f"receiver TTFT (ms, {result['context_tokens']}-token contexts)")
    ax.set_ylabel("quality (test split)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
