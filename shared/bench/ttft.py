"""`droidmesh bench ttft`: receiver time-to-first-token per prefill mode, in process.

Measures the receiver's compute only (the sender's cache is already in memory): full prefill,
full reuse, and partial prefill recomputing k = 1, 2, 4, ... layers, at several context lengths.
Beside each measured speedup over full prefill stands the ideal bound L / k (recompute cost is
linear in the recomputed layers; the suffix and the first token add a little on top).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.bench import report
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter

QUESTION_TOKENS = 32


def recompute_sizes(num_layers: int) -> list[int]:
    """k = 1, 2, 4, ... below L."""
    ks, k = [], 1
    while k < num_layers:
        ks.append(k)
        k *= 2
    return ks


def plans(num_layers: int) -> Iterator[ReusePlan]:
    yield ReusePlan.full_prefill()
    yield ReusePlan.full_reuse()
    for k in recompute_sizes(num_layers):
        yield ReusePlan.recompute(0, k)


def measure(model: ModelAdapter, contexts: Sequence[int], repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Median TTFT of `repeats` runs per (context length, plan); one warm-up run first."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    L = model.num_layers
    grid = [(n, p) for n in contexts for p in plans(L)]
    rows: list[dict[str, Any]] = []
    full_ttft: dict[int, float] = {}
    bar = tqdm(grid, desc="ttft", unit="config")
    for n, plan in bar:
        bar.set_postfix_str(f"{n} tok, {plan.label()}")
        ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompt = ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
        source = CapturedSource(capture_prefill(model, ctx, e_layers=plan.e_layers))
        times = [generate(model, prompt, plan, source, max_new_tokens=1).ttft_s for _ in range(repeats + 1)][1:]
        ttft = statistics.median(times)
        k = len(plan.recomputed_layers(L))
        if plan.mode == "full_prefill":
            full_ttft[n] = ttft
        rows.append(
            {
                "context_tokens": n,
                "mode": plan.mode if plan.mode != "groups" else "partial",
                "recomputed_layers": k,
                "total_layers": L,
                "ttft_s": ttft,
                "speedup": full_ttft[n] / ttft,
                "ideal_speedup": (L / k) if 0 < k else None,
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n in sorted({r["context_tokens"] for r in rows}):
        part = [r for r in rows if r["context_tokens"] == n and r["mode"] == "partial"]
        xs, ys = [r["recomputed_layers"] for r in part], [r["speedup"] for r in part]
        ax.plot(xs, ys, "o-", label=f"{n} tokens")
        report.label_points(ax, xs, ys, "{:.2f}")
    if part:
        ks = [r["recomputed_layers"] for r in part]
        ax.plot(ks, [part[0]["total_layers"] / k for k in ks], "k--", label="ideal L/k")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("recomputed layers k")
    ax.set_ylabel("TTFT speedup over full prefill")
    ax.set_title("Receiver TTFT: partial prefill vs full prefill")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
