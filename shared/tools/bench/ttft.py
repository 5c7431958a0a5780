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

from droidmesh.shared import report
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


def plans(num_layers: int, ks: Sequence[int] | None = None) -> Iterator[ReusePlan]:
    """Full prefill, full reuse, then recompute k layers from layer 0 for each k of `ks` below L
    (default `recompute_sizes`)."""
    yield ReusePlan.full_prefill()
    yield ReusePlan.full_reuse()
    for k in ks if ks is not None else recompute_sizes(num_layers):
        if 0 < k < num_layers:
            yield ReusePlan.recompute(0, k)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    """The device's peak allocated memory since the last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / (1 << 30)


def measure(model: ModelAdapter, contexts: Sequence[int], repeats: int, seed: int = 0,
            ks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Median TTFT of `repeats` runs per (context length, plan) after one warm-up, with the
    device's peak memory per plan. Each context is captured once (none of the plans reads E:
    groups start at layer 0, whose input is the receiver's own embedding)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    L = model.num_layers
    grid = [(n, p) for n in contexts for p in plans(L, ks)]
    rows: list[dict[str, Any]] = []
    full_ttft: dict[int, float] = {}
    prompts: dict[int, tuple[list[int], CapturedSource]] = {}
    bar = tqdm(grid, desc="ttft", unit="config")
    for n, plan in bar:
        bar.set_postfix_str(f"{n} tok, {plan.label()}")
        if n not in prompts:
            prompts.clear()  # one context's capture held at a time
            ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
            prompts[n] = (ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist(),
                          CapturedSource(capture_prefill(model, ctx)))
        prompt, source = prompts[n]
        _peak_reset(model.device)
        times = [generate(model, prompt, plan, source, max_new_tokens=1).ttft_s for _ in range(repeats + 1)][1:]
        ttft = statistics.median(times)
        k = len(plan.recomputed_layers(L))
        if plan.mode == "full_prefill":
            full_ttft[n] = ttft
        rows.append(
            {
                "context_tokens": n,
                "mode": plan.mode if plan.mode != "groups" else "partial",
                "plan": plan.label(),
                "recomputed_layers": k,
                "total_layers": L,
                "ttft_s": ttft,
                "speedup": full_ttft[n] / ttft,
                "ideal_speedup": (L / k) if 0 < k else None,
                "peak_mem_gib": _peak_gib(model.device),
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = report.pyplot()

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
