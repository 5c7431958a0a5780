"""`droidmesh profile`: offline profile of a sender -> receiver pair (optionally published)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click


@click.command()
@click.option("--sender", required=True, help="Sender checkpoint path or zoo model name.")
@click.option("--receiver", required=True, help="Receiver checkpoint path or zoo model name.")
@click.option("--task", required=True, help="Zoo task (multihop_qa, summarization, code_completion) or a name.")
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="Write the profile here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the frontier PNG here.")
@click.option("--n-train", default=50, show_default=True, type=click.IntRange(1, 10000))
@click.option("--n-test", default=50, show_default=True, type=click.IntRange(1, 10000))
@click.option("--data-train", type=click.Path(exists=True, dir_okay=False), help="LongBench-style JSONL (train).")
@click.option("--data-test", type=click.Path(exists=True, dir_okay=False), help="LongBench-style JSONL (test).")
@click.option("--granularity", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--tolerance", default=0.05, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--exhaustive/--guided-only", default=True, show_default=True,
              help="Also run the O((L/g)^2) search to compare with the guided one.")
@click.option("--robustness/--no-robustness", default=True, show_default=True,
              help="Apply the chosen config to the test split of other tasks (DroidSpeak §5.4).")
@click.option("--other-task", "other_tasks", multiple=True,
              help="A task or shift (e.g. multihop_qa/long) to check robustness on (repeatable; "
                   "default: the task's shifts and every other zoo task).")
@click.option("--publish", "nats_url", default=None, help="Also publish the config to this NATS server's bucket.")
def profile(sender, receiver, task, json_path, plot_path, n_train, n_test, data_train, data_test, granularity,  # type: ignore[no-untyped-def]
            tolerance, exhaustive, robustness, other_tasks, nats_url) -> None:
    """Find the pair's recompute group: sensitivity, searches, Pareto frontier, chosen config."""
    from shared.cli.models import resolve
    from shared.errors import BadRequestError
    from shared.profiling.plot import frontier_png
    from shared.profiling.profile import ProfileSettings, profile_checkpoints

    s_path, s_name = resolve(sender)
    r_path, r_name = resolve(receiver)
    settings = ProfileSettings(granularity=granularity, tolerance=tolerance, exhaustive=exhaustive)
    try:
        result, cfg = profile_checkpoints(s_path, r_path, task, settings, n_train=n_train, n_test=n_test,
                                          data_train=data_train, data_test=data_test, sender_model=s_name,
                                          receiver_model=r_name,
                                          other_tasks=(list(other_tasks) or None) if robustness else [])
    except BadRequestError as e:  # bad arguments (an unknown --other-task, ...): a usage error, not a traceback
        raise click.UsageError(str(e)) from e
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    if plot_path:
        frontier_png(result, plot_path, result["evaluated"])
    ch, fp, fr = result["chosen"], result["full_prefill"], result["full_reuse"]
    click.echo(f"{s_name} -> {r_name} on {task} ({result['total_layers']} layers)")
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
        click.echo(f"  published {cfg.sender_model}.{cfg.receiver_model}.v{cfg.profile_version}")


async def _publish(url: str, cfg) -> None:  # type: ignore[no-untyped-def]
    from shared.client import MeshClient
    from shared.config_board import NatsConfigBoard

    client = await MeshClient.connect(url)
    try:
        await NatsConfigBoard(client.bus.nc).put(cfg)  # type: ignore[attr-defined]
    finally:
        await client.close()
