"""The profile's picture: quality vs recomputed layers, frontier, choice and references."""

from __future__ import annotations

from typing import Any


def frontier_png(result: dict[str, Any], path: str, all_points: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    if all_points:
        ax.scatter([p["recomputed_layers"] for p in all_points], [p["quality"] for p in all_points],
                   s=14, c="0.7", label="evaluated groups")
    front = result["frontier"]
    ax.plot([p["recomputed_layers"] for p in front], [p["quality"] for p in front], "o-", c="C0", label="Pareto frontier")
    fp, fr = result["full_prefill"]["quality_train"], result["full_reuse"]["quality_train"]
    ax.axhline(fp, c="C2", ls="--", label=f"full prefill ({fp:.2f})")
    ax.axhline((1 - result["tolerance"]) * fp, c="C2", ls=":", label=f"-{result['tolerance']:.0%} target")
    ax.axhline(fr, c="C3", ls="--", label=f"full reuse ({fr:.2f})")
    ch = result["chosen"]
    ax.scatter([ch["recomputed_layers"]], [ch["quality_train"]], s=120, facecolors="none", edgecolors="k", zorder=5,
               label=f"chosen [{ch['start']},{ch['end']})")
    sc = result["scattered_critical"]
    if sc["recomputed_layers"]:
        ax.scatter([sc["recomputed_layers"]], [sc["quality_train"]], marker="x", c="C1", s=60, zorder=5,
                   label="critical layers only")
    ax.set_xlabel("recomputed layers")
    ax.set_ylabel(f"quality ({result.get('task') or 'train split'})")
    ax.set_xlim(-0.3, result["total_layers"] + 0.3)
    ax.set_title(f"{result.get('sender', '')} -> {result.get('receiver', '')}: recompute profile")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
