"""The relay audit's outputs for people: the table and summary lines on stdout, and the plot.

Called by `shared/tools/cli/audit.py` with an `estimate.audit` result, which it trusts to have every
field `audit` writes. `plot_png` blocks on matplotlib (imported there, Agg backend) and writes
one PNG, creating its folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from droidmesh.shared import report
from droidmesh.shared.audit.estimate import CI_LEVEL
from droidmesh.shared.audit.relay import relay_decision

COLUMNS = ("stratum", "requests", "treatment", "control", "ate_ttft_s", "ci_low", "ci_high",
           "policy_p50_ttft_s", "full_prefill_p50_ttft_s", "quality_agreement", "blind", "blind_p50_ttft_s")


def format_report(result: dict[str, Any]) -> str:
    from droidmesh.shared.report import format_table

    o = result["overall"]
    lines = [format_table([o, *result["strata"]], COLUMNS), ""]
    for name, unit in (("ttft_s", "s"), ("e2e_s", "s"), ("bytes", "B"), ("agreement", "")):
        e = o["effects"][name]
        ci = f" [{e['ci_low']:.4g}, {e['ci_high']:.4g}]" if e["ci_low"] is not None else ""
        value = f"{e['ate']:.4g}{unit}{ci}" if e["ate"] is not None else "n/a"
        lines.append(f"effect of relaying on {name}: {value} ({e['treatment']} treatment, {e['control']} control)")
    fig = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    lines.append(f"worst stratum ratio {fig(result['worst_stratum_ratio'])} ({result['worst_stratum'] or '-'}), "
                 f"blind relay's {fig(result['blind_worst_stratum_ratio'])} ({result['blind_worst_stratum'] or '-'}); "
                 f"top stratum speedup {fig(result['top_stratum_speedup'])}; "
                 f"prediction error (median relative) {fig(result['prediction_error'])}; "
                 f"decision p99 {fig(result['decision_p99_s'] * 1e3 if result['decision_p99_s'] is not None else None)} ms")
    lines.append(f"{result['requests_used']} requests from {result['lines_read']} lines in {result['files']} files "
                 f"({result['other_request_lines']} outside the experiment, {result['malformed_request_lines']} malformed, "
                 f"{result['duplicate_request_lines']} duplicates); {CI_LEVEL:.0%} CI, {result['bootstrap']} resamples")
    return "\n".join(lines)


def plot_png(result: dict[str, Any], path: str | Path) -> None:
    """Per stratum ATE on TTFT with its CI, horizontal bars (first stratum on top), blind relay's as
    a marker under each; no-data strata labelled."""
    plt = report.pyplot()

    from droidmesh.shared.report import label_bars

    rows = [result["overall"], *result["strata"]]
    y = np.arange(len(rows))[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.4))
    have = [(yy, r) for yy, r in zip(y, rows, strict=True) if r["ate_ttft_s"] is not None]
    ates = [r["ate_ttft_s"] * 1e3 for _, r in have]
    err = [[(r["ate_ttft_s"] - r["ci_low"]) * 1e3 if r["ci_low"] is not None else 0 for _, r in have],
           [(r["ci_high"] - r["ate_ttft_s"]) * 1e3 if r["ci_high"] is not None else 0 for _, r in have]]
    colours = ["C2" if relay_decision(r) else "C3" if relay_decision(r) is False else "0.6" for _, r in have]
    bars = ax.barh([yy for yy, _ in have], ates, 0.6, xerr=err, color=colours, alpha=0.8, capsize=2, ecolor="k")
    label_bars(ax, bars, "{:.1f}")
    blind = [(yy, r) for yy, r in zip(y, rows, strict=True) if r.get("blind_ate_ttft_s") is not None]
    if blind:  # relaying itself (the blind arm), under each bar
        ax.errorbar([r["blind_ate_ttft_s"] * 1e3 for _, r in blind], [yy - 0.3 for yy, _ in blind],
                    xerr=[[(r["blind_ate_ttft_s"] - (r["blind_ci_low"] or r["blind_ate_ttft_s"])) * 1e3 for _, r in blind],
                          [((r["blind_ci_high"] or r["blind_ate_ttft_s"]) - r["blind_ate_ttft_s"]) * 1e3 for _, r in blind]],
                    fmt="D", ms=3, c="C1", lw=0.8, capsize=2, label="blind relay (always relay) vs control")
        ax.legend(fontsize=7, loc="lower right")
    for yy, r in zip(y, rows, strict=True):
        if r["ate_ttft_s"] is None:
            ax.annotate("no data" if not r["requests"] else "one arm only", (0, yy), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=6, color="0.4")
    ax.axvline(0, c="k", lw=0.8)
    ax.set_yticks(y, [f"{r['stratum']} ({r['treatment']}/{r['control']})" for r in rows], fontsize=7)
    ax.set_xlabel(f"effect of relaying on TTFT, ms (treatment - control, {CI_LEVEL:.0%} CI); green: relay pays")
    ax.set_title(f"KV relay audit: {result['requests_used']} requests (treatment/control per stratum)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
