"""`droidmesh audit`: the causal audit of KV relay from receivers' request logs."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("audit")
@click.option("--logs", "logs_dir", required=True, type=click.Path(file_okay=False),
              help="Directory of receiver logs (*.log, *.jsonl, *.txt, searched recursively).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the audit JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: per stratum effect on TTFT with its confidence interval.")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False), default=None,
              help="Write a policy file proposal: relay or not per reusable-prefix bucket.")
@click.option("--bootstrap", "n_boot", type=click.IntRange(0, 1_000_000), default=2000, show_default=True,
              help="Bootstrap resamples per interval (0: no intervals).")
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
def audit(logs_dir: str, json_path: str | None, plot_path: str | None, policy_path: str | None, n_boot: int,
          seed: int) -> None:
    """Effect of relaying (treatment) vs the randomized full-prefill holdout (control), overall and per stratum."""
    from droidmesh.shared.audit.estimate import run_audit
    from droidmesh.shared.audit.relay import policy_proposal
    from droidmesh.shared.audit.render import format_report, plot_png

    result = run_audit(logs_dir, n_boot=n_boot, seed=seed)
    for path, payload in ((json_path, result), (policy_path, policy_proposal(result) if policy_path else None)):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    if plot_path is not None:
        plot_png(result, plot_path)
    click.echo(format_report(result))
