"""`droidmesh bench screen`: the receiver's KV screen on real pairs, honest pulls against attacks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import launched_device_option, save

if TYPE_CHECKING:
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.adapter import ModelAdapter
    from droidmesh.shared.model.names import ModelRef

DEFAULT_PAIRS = "real/base:real/docqa,real/base:real/summ,real/base:real/code"


def _plan(sender_ref: ModelRef, receiver_ref: ModelRef, plan_arg: str) -> ReusePlan:
    """The pair's profiled plan (its tier's `profiles/<sender>-to-<receiver>.json`), or full reuse."""
    from droidmesh.shared.kv.policy import plan_of
    from droidmesh.shared.tools.apps.serve_config import load_config

    if plan_arg == "full_reuse":
        from droidmesh.shared.kv.plan import ReusePlan

        return ReusePlan.full_reuse()
    profile = Path(receiver_ref.path).parent / "profiles" / f"{sender_ref.name}-to-{receiver_ref.name}.json"
    if not profile.is_file():
        raise click.BadParameter(f"no profile {profile} for the pair; use --plan full_reuse", param_hint="'--plan'")
    return plan_of(load_config(str(profile)).chosen.plan)


@click.command()
@click.option("--pairs", default=DEFAULT_PAIRS, show_default=True,
              help="Comma list of SENDER:RECEIVER (zoo names or checkpoints).")
@click.option("--contexts", "n", default=350, show_default=True, type=click.IntRange(2, 5000),
              help="Honest pulls per pair (real test-split text, one context each); each attacked once per attack.")
@click.option("--tokens", default=512, show_default=True, type=click.IntRange(64, 8192), help="Context tokens.")
@click.option("--plan", "plan_arg", type=click.Choice(["profile", "full_reuse"]), default="profile", show_default=True,
              help="What the receiver pulls: the pair's profiled plan, or every layer's K/V.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
@click.option("--attack-every", default=1, show_default=True, type=click.IntRange(1, 100),
              help="Attack every N-th context only (each attack costs a screening; honest pulls are every context).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every pair's result here.")
@launched_device_option
def screen(pairs, n, tokens, plan_arg, dtype, attack_every, seed, json_path, device) -> None:
    """False positives of the receiver's KV screen on honest pulls, and its catch rate per attack
    (sign flips per kind and layer count, another context's cache, zeros, noise, scale)."""
    import torch

    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tools.bench import screen as suite
    from droidmesh.shared.zoo.manifest import resolve_model

    loaded: dict[str, ModelAdapter] = {}  # checkpoint -> model: pairs of one sender share its captures

    def load(ref: ModelRef) -> ModelAdapter:
        if str(ref.path) not in loaded:
            loaded[str(ref.path)] = load_model(ref.path, device=device, dtype=dtype, name=ref.name)
        return loaded[str(ref.path)]

    groups: dict[str, list[suite.Pair]] = {}
    for spec in (p.strip() for p in pairs.split(",") if p.strip()):
        s_arg, sep, r_arg = spec.partition(":")
        if not sep:
            raise click.BadParameter(f"{spec!r}: expected SENDER:RECEIVER", param_hint="'--pairs'")
        try:
            s_ref, r_ref = resolve_model(s_arg), resolve_model(r_arg)
            pair = suite.Pair(f"{s_ref.name}->{r_ref.name}", load(s_ref), load(r_ref), _plan(s_ref, r_ref, plan_arg))
        except DroidMeshError as e:
            raise click.ClickException(str(e)) from None
        groups.setdefault(str(s_ref.path), []).append(pair)
    results = []
    for group in groups.values():
        try:
            contexts = suite.contexts(group[0].receiver.tokenizer, n, tokens, seed)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        with torch.inference_mode():
            results += suite.run_pairs(group, contexts, seed, attack_every)
        for r in results[-len(group):]:
            click.echo(f"{r['pair']}: {r['false_positives']} of {r['honest_pulls']} honest pulls refused", err=True)
    click.echo(report.format_table(suite.table_rows(results), suite.COLUMNS))
    save(json_path, "screen", {"contexts": n, "tokens": tokens, "plan": plan_arg, "dtype": dtype, "device": device,
                               "seed": seed,
                               "attack_every": attack_every, "pairs": results})


COMMANDS = [screen]
