"""`droidmesh profile`: offline profile of a sender -> receiver pair (optionally published)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from droidmesh.shared.cli.models import MODEL_HELP, device_options, model_arg
from droidmesh.shared.tasks.spec import METRIC_NAMES


@click.command()
@click.option("--sender", required=True, callback=model_arg, help=f"Sender: {MODEL_HELP}.")
@click.option("--receiver", required=True, callback=model_arg, help=f"Receiver: {MODEL_HELP}.")
@click.option("--task", required=True,
              help="Zoo task (multihop_qa, summarization, code_completion), or a name for your --data.")
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="Write the profile here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the frontier PNG here.")
@click.option("--n-train", default=50, show_default=True, type=click.IntRange(1, 10000), help="Train rows (at most).")
@click.option("--n-test", default=50, show_default=True, type=click.IntRange(1, 10000), help="Test rows (at most).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="Your LongBench-style JSONL ({context, input, answers}), split in two: a fixed shuffle of "
                   "its rows puts half in test, the rest in train (the same file always splits the same way).")
@click.option("--data-train", type=click.Path(exists=True, dir_okay=False), help="JSONL train rows (with --data-test).")
@click.option("--data-test", type=click.Path(exists=True, dir_okay=False), help="JSONL test rows (with --data-train).")
@click.option("--metric", type=click.Choice(METRIC_NAMES), default=None,
              help="Answer metric (default: the zoo task's; f1 for your own task).")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None,
              help="Answer length in tokens (default: the zoo task's; 16 for your own task).")
@click.option("--stop", multiple=True,
              help="Cut answers at this string (repeatable; default: the zoo task's; a newline for your own task).")
@click.option("--granularity", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--tolerance", default=0.05, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--exhaustive/--guided-only", default=True, show_default=True,
              help="Also run the O((L/g)^2) search to compare with the guided one.")
@click.option("--robustness/--no-robustness", default=True, show_default=True,
              help="Apply the chosen config to the test split of other tasks (DroidSpeak §5.4).")
@click.option("--other-task", "other_tasks", multiple=True,
              help="A zoo task or shift (e.g. multihop_qa/long), or a JSONL file, to check robustness on "
                   "(repeatable; default: for a zoo task, its shifts and every other zoo task).")
@device_options
@click.option("--publish", "nats_url", default=None, help="Also publish the config to this NATS server's bucket.")
def profile(sender, receiver, task, json_path, plot_path, n_train, n_test, data, data_train, data_test, metric,
            max_new_tokens, stop, granularity, tolerance, exhaustive, robustness, other_tasks, device, dtype,
            nats_url) -> None:
    """Find the pair's recompute group: sensitivity, searches, Pareto frontier, chosen config."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.models import Pair
    from droidmesh.shared.profiling.plot import frontier_png
    from droidmesh.shared.profiling.profile import ProfileSettings, profile_checkpoints

    settings = ProfileSettings(granularity=granularity, tolerance=tolerance, exhaustive=exhaustive)
    try:
        result, cfg = profile_checkpoints(sender, receiver, task, settings, n_train=n_train, n_test=n_test, data=data,
                                          data_train=data_train, data_test=data_test, metric=metric,
                                          max_new_tokens=max_new_tokens, stop=tuple(stop) or None, device=device,
                                          dtype=dtype, other_tasks=(list(other_tasks) or None) if robustness else [])
    except DroidMeshError as e:  # bad arguments (an unknown --other-task, a bad JSONL row, no GPU): one line
        raise click.UsageError(str(e)) from None
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    if plot_path:
        frontier_png(result, plot_path, result["evaluated"])
    pair = Pair(sender.name, receiver.name)
    ch, fp, fr = result["chosen"], result["full_prefill"], result["full_reuse"]
    click.echo(f"{pair.id} on {task} ({result['total_layers']} layers)")
    click.echo(f"  full prefill  train {fp['quality_train']:.3f}  test {fp['quality_test']:.3f}")
    click.echo(f"  full reuse    train {fr['quality_train']:.3f}  test {fr['quality_test']:.3f}")
    click.echo(f"  chosen [{ch['start']},{ch['end']}) ({ch['recomputed_layers']} layers)  "
               f"train {ch['quality_train']:.3f}  test {ch['quality_test']:.3f}")
    sc = result["scattered_critical"]
    click.echo(f"  critical layers {result['critical_layers']}  recomputed alone: train {sc['quality_train']:.3f}"
               f"  test {sc['quality_test']:.3f}")
    sp = result["chosen_split"]
    click.echo(f"  chosen layers as {len(sp['groups'])} one-layer groups ({sp['e_transitions']} E transitions): "
               f"train {sp['quality_train']:.3f}  test {sp['quality_test']:.3f}")
    ev = result["evaluations"]
    click.echo(f"  searches agree: {result['searches_agree']}  (exhaustive {ev['exhaustive']} configs, "
               f"guided {ev['guided']} + {ev['sensitivity']} sensitivity)")
    for r in result["robustness"]:
        click.echo(f"  robustness {r['task']:<22} full prefill {r['full_prefill']:.3f}  chosen {r['chosen']:.3f}  "
                   f"difference {r['difference']:+.3f}"
                   + (f" ({r['relative']:+.1%})" if r["relative"] is not None else " (receiver scores 0 here)"))
    if nats_url:
        asyncio.run(_publish(nats_url, cfg))
        click.echo(f"  published {pair.versioned(cfg.profile_version)}")


async def _publish(url: str, cfg) -> None:
    from droidmesh.shared.client import MeshClient

    client = await MeshClient.connect(url)
    try:
        await client.bus.config_board().put(cfg)
    finally:
        await client.close()
