"""`droidmesh demo`: the main job — a real mesh over two zoo pairs, TTFT and quality per path."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--rows", default=8, show_default=True, type=click.IntRange(1, 200), help="Contexts per pair.")
@click.option("--tier", type=click.Choice(["auto", "demo", "ci"]), default="auto", show_default=True,
              help="auto: the committed demo tier, else the ci tier (built if needed).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the summary rows here.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep every process's log here.")
def demo(rows: int, tier: str, json_path: str | None, log_dir: str | None) -> None:
    """Start nats-server, a broker, senders and receivers; ask; print TTFT and quality per path."""
    from shared.cli.models import REPO_ZOO
    from shared.demo import Pair, run_demo, table
    from shared.zoo.build import build_tier, read_manifest
    from shared.zoo.tiers import get_recipe

    root = REPO_ZOO / "demo"
    manifest = read_manifest(root) if tier in ("auto", "demo") else None
    if manifest is None:
        if tier == "demo":
            raise click.ClickException(f"no committed demo tier at {root}; run `droidmesh zoo build --tier demo --out {root}`")
        click.echo("demo tier absent: using the ci tier (tiny models: latency shape only, quality NOT meaningful)", err=True)
        from shared.zoo.build import zoo_dir

        root = zoo_dir("ci")
        manifest = build_tier("ci", root, log=lambda s: click.echo(f"  zoo: {s}", err=True))
    tier_name = manifest["tier"]
    recipe = get_recipe(tier_name)
    models = manifest["models"]
    pairs = [Pair(p["sender"], p["receiver"], p["task"], str(root / models[p["sender"]]["path"]),
                  str(root / models[p["receiver"]]["path"])) for p in manifest["pairs"][:2]]
    profiles = {}
    for p in pairs:
        f = root / "profiles" / f"{p.sender}__{p.receiver}.json"
        if f.is_file():
            profiles[(p.sender, p.receiver)] = json.loads(f.read_text())
    layers = json.loads((Path(pairs[0].receiver_path) / "config.json").read_text())["num_hidden_layers"]
    click.echo(f"DroidMesh demo: tier {tier_name}, pairs " + ", ".join(f"{p.sender}->{p.receiver} ({p.task})" for p in pairs))
    summary = run_demo(pairs, rows, profiles, recipe.suite, layers, lambda s: click.echo(s, err=True),
                       Path(log_dir) if log_dir else None)
    click.echo(table(summary))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"tier": tier_name, "rows": summary}, indent=2) + "\n")
