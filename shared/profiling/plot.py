"""The profile's picture: quality vs recomputed layers, frontier, choice and references."""

from __future__ import annotations

from typing import Any

from droidmesh.shared import report
from droidmesh.shared.model.names import Pair
from droidmesh.shared.report import label_bars, label_points


def frontier_png(result: dict[str, Any], path: str, all_points: list[dict[str, Any]] | None = None) -> None:
    plt = report.pyplot()

    robust = result.get("robustness") or []
    if len(robust) > 1:
        fig, (ax, rax) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
        _robustness_bars(rax, robust, result["chosen"])
    else:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
    if all_points:
        ax.scatter([p["recomputed_layers"] for p in all_points], [p["quality"] for p in all_points],
                   s=14, c="0.7", label="evaluated groups")
    front = result["frontier"]
    ax.plot([p["recomputed_layers"] for p in front], [p["quality"] for p in front], "o-", c="C0", label="Pareto frontier")
    label_points(ax, [p["recomputed_layers"] for p in front], [p["quality"] for p in front], "{:.2f}")
    fp, fr = result["full_prefill"]["quality_train"], result["full_reuse"]["quality_train"]
    ax.axhline(fp, c="C2", ls="--", label=f"full prefill ({fp:.2f})")
    ax.axhline((1 - result["tolerance"]) * fp, c="C2", ls=":", label=f"-{result['tolerance']:.0%} target")
    ax.axhline(fr, c="C3", ls="--", label=f"full reuse ({fr:.2f})")
    ch = result["chosen"]
    ax.scatter([ch["recomputed_layers"]], [ch["quality_train"]], s=120, facecolors="none", edgecolors="k", zorder=5,
               label=f"chosen [{ch['start']},{ch['end']})")
    sc = result["scattered_critical"]
    if sc and sc["recomputed_layers"]:  # None after a coarse search (no sensitivity pass)
        ax.scatter([sc["recomputed_layers"]], [sc["quality_train"]], marker="x", c="C1", s=60, zorder=5,
                   label="critical layers only")
    sp = result.get("chosen_split")
    if sp and len(sp["groups"]) > 1:
        ax.scatter([sp["recomputed_layers"]], [sp["quality_train"]], marker="v", c="C4", s=60, zorder=5,
                   label=f"chosen layers, {sp['e_transitions']} E transitions")
    ax.set_xlabel("recomputed layers")
    ax.set_ylabel(f"quality ({result.get('task') or 'train split'})")
    ax.set_xlim(-0.3, result["total_layers"] + 0.3)
    ax.set_title(f"{Pair(result.get('sender', ''), result.get('receiver', '')).id}: recompute profile")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _robustness_bars(ax, rows: list[dict[str, Any]], chosen: dict[str, Any]) -> None:
    """Per task or shift (test split): full prefill, the chosen config, full reuse (does the config chosen on one split hold on others?)."""
    import numpy as np

    y = np.arange(len(rows))[::-1]  # first row (the profiled task) on top
    for i, (key, colour, label) in enumerate((("full_prefill", "C2", "full prefill"),
                                              ("chosen", "k", f"chosen [{chosen['start']},{chosen['end']})"),
                                              ("full_reuse", "C3", "full reuse"))):
        bars = ax.barh(y + (1 - i) * 0.27, [r[key] for r in rows], 0.27, color=colour, alpha=0.75, label=label)
        label_bars(ax, bars)
    ax.set_yticks(y, [f"{r['task']} ({r['metric'] or 'quality'})" for r in rows], fontsize=7)
    ax.set_xlim(0, max([1.0, *(r[k] * 1.15 for r in rows for k in ("full_prefill", "chosen", "full_reuse"))]))
    ax.set_xlabel("quality, test split")
    ax.set_title("the chosen config on shifted data and other tasks", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def transfer_png(result: dict[str, Any], path: str, gbit_s: float = 0.25) -> None:
    """The transfer search: train quality vs predicted TTFT at `gbit_s` and the longest predicted
    context, one point per config (filled: meets the quality rule)."""
    plt = report.pyplot()

    t = result["transfer"]
    tokens = str(max(t["tokens"]))
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, c in enumerate(t["configs"]):
        x, y = c["predicted_ttft_s"][tokens][f"{gbit_s:g}"] * 1e3, c["quality_train"]
        colour = f"C{i % 10}"
        ax.scatter([x], [y], s=40, c=colour if c["meets_rule"] else "none", edgecolors=colour,
                   label=f"{c['name']} ({c['wire_bytes_per_token']} B/token)")
    ax.axhline(t["rule"]["target"], c="C2", ls=":", label=f"-{t['rule']['tolerance']:.0%} target")
    ax.axvline(t["full_prefill_ttft_s"][tokens] * 1e3, c="0.5", ls="--", label="full prefill (no transfer)")
    ax.set_xlabel(f"predicted TTFT, ms ({tokens} tokens, {gbit_s:g} Gbit/s, pipelined)")
    ax.set_ylabel(f"quality ({result.get('task') or 'train split'}, train)")
    ax.set_title(f"{Pair(result.get('sender', ''), result.get('receiver', '')).id}: transfer configs")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
