"""`droidmesh eval`: quality of a sender -> receiver pair under each KV-reuse path."""

from __future__ import annotations

import json
from pathlib import Path

import click

from droidmesh.shared.cli.models import MODEL_HELP, device_options, model_arg
from droidmesh.shared.tasks.spec import METRIC_NAMES


@click.command("eval")
@click.option("--sender", required=True, callback=model_arg, help=f"Sender: {MODEL_HELP}.")
@click.option("--receiver", required=True, callback=model_arg, help=f"Receiver: {MODEL_HELP}.")
@click.option("--task", required=True, help="multihop_qa | summarization | code_completion (or a name for --data).")
@click.option("--split", type=click.Choice(["train", "test"]), default="test", show_default=True)
@click.option("--data", "data_path", type=click.Path(exists=True, dir_okay=False),
              help="A LongBench-style JSONL dataset instead of the zoo's generated split.")
@click.option("--metric", type=click.Choice(METRIC_NAMES), default=None,
              help="Metric for a --data task the zoo does not know (default f1).")
@click.option("--n", "n_rows", type=click.IntRange(1, 100000), default=None, help="Rows to evaluate (default: the tier's).")
@click.option("--group-sizes", default=None, help="Comma-separated recompute-group sizes (default: all).")
@device_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write the eval JSON here.")
@click.option("--predictions", is_flag=True, help="Include per-row predictions in the JSON.")
def eval_cmd(sender, receiver, task: str, split: str, data_path: str | None, metric: str | None,
             n_rows: int | None, group_sizes: str | None, device: str, dtype: str | None, json_path: str,
             predictions: bool) -> None:
    """Score sender alone, receiver full prefill, full reuse, per-layer reuse and best groups."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tasks.jsonl import read_jsonl
    from droidmesh.shared.tasks.report import evaluate_pair
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.zoo.suite import SuiteShape, make_rows
    from droidmesh.shared.zoo.tiers import get_recipe

    spec = task_spec(task, metric=metric)
    try:
        if data_path is not None:
            rows = read_jsonl(data_path)
        else:
            recipe = get_recipe(receiver.tier) if receiver.tier else None
            shape = recipe.suite if recipe else SuiteShape()
            rows = make_rows(task, split, n_rows or (recipe.eval_rows if recipe else 48), shape)
        rows = rows[:n_rows] if n_rows else rows
        sizes = [int(s) for s in group_sizes.split(",")] if group_sizes else None
        s_model = load_model(sender.path, device=device, dtype=dtype)
        r_model = load_model(receiver.path, device=device, dtype=dtype)
    except (DroidMeshError, ValueError) as e:  # a bad dataset, task, device or group size: one line
        raise click.UsageError(str(e)) from None
    ev = evaluate_pair(s_model, r_model, rows, spec, group_sizes=sizes, keep_predictions=predictions)
    ev.update({"sender": sender.label, "receiver": receiver.label, "split": split, "data": data_path or "zoo"})
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(ev, indent=2) + "\n")
    click.echo(format_table(ev))


def format_table(ev: dict) -> str:
    """A short text table of the headline paths and the must-show summary."""
    fp = ev["receiver_full_prefill"]["quality"]
    lines = [f"{ev['task']} ({ev['metric']}, {ev['rows']} rows, {ev['total_layers']} layers)",
             f"{'path':28s} {'quality':>8s} {'nll':>8s} {'kl':>8s} {'top1':>6s}"]
    def row(name, r):
        return f"{name:28s} {r['quality']:8.4f} {r['answer_nll']:8.4f} {r['kl']:8.4f} {r['top1_agreement']:6.3f}"
    lines += [row("sender alone", ev["sender_alone"]), row("receiver full prefill", ev["receiver_full_prefill"]),
              row("receiver full reuse", ev["receiver_full_reuse"])]
    lines += [row(f"reuse only layer {p['layer']}", p) for p in ev["per_layer_reuse"]]
    lines += [row(f"recompute [{g['start']},{g['end']})", g) for g in ev["best_groups"]]
    s = ev["summary"]
    lines.append(f"full reuse loses {s['full_reuse_relative_loss']:.1%} of {fp:.4f}; critical layers {s['critical_layers']} "
                 f"({s['critical_fraction']:.0%}); smallest restoring group {s['smallest_restoring_group']}")
    return "\n".join(lines)
