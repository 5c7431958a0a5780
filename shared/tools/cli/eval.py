"""`droidmesh eval`: quality of a sender -> receiver pair under each KV-reuse path."""

from __future__ import annotations

import json
from pathlib import Path

import click

from droidmesh.shared.tasks.intervals import versus_text
from droidmesh.shared.tasks.spec import METRIC_NAMES
from droidmesh.shared.tools.cli.model_options import MODEL_HELP, device_options, model_arg


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
@click.option("--group-stride", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Groups start every N layers (the topmost start is always included).")
@click.option("--layer-stride", type=click.IntRange(0, 1000), default=1, show_default=True,
              help="Per-layer probes every N layers; 0: none (each recomputes all but one layer).")
@device_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write the eval JSON here.")
@click.option("--predictions", is_flag=True, help="Include per-row predictions in the JSON.")
@click.option("--translator", "translator_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A translated pair (models of other sizes, families or tokenizers): the translator file "
                   "`droidmesh profile --translate` wrote; scores translated KV instead of reused KV.")
@click.option("--translator-sha256", default=None, help="Refuse the translator unless its file has this sha256.")
def eval_cmd(sender, receiver, task: str, split: str, data_path: str | None, metric: str | None,
             n_rows: int | None, group_sizes: str | None, group_stride: int, layer_stride: int, device: str,
             dtype: str | None, json_path: str, predictions: bool, translator_path: str | None, translator_sha256: str | None) -> None:
    """Score sender alone, receiver full prefill, full reuse, per-layer reuse and best groups
    (with --translator: receiver full prefill, translated, translated with layers [0, k)
    recomputed, the receiver without the context, and the prefill cost saved)."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.kv import translate
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling.job import format_translated
    from droidmesh.shared.tasks.evaluation import evaluate_pair
    from droidmesh.shared.tasks.jsonl import read_jsonl
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tasks.translated import evaluate_translated
    from droidmesh.shared.zoo.tiers import TIERS, get_recipe

    spec = task_spec(task, metric=metric)
    try:
        if data_path is not None:
            rows = read_jsonl(data_path)
        else:
            recipe = get_recipe(receiver.tier) if receiver.tier in TIERS else None
            shape = recipe.suite if recipe else SuiteShape()
            rows = make_rows(task, split, n_rows or (recipe.eval_rows if recipe else 48), shape)
        rows = rows[:n_rows] if n_rows else rows
        sizes = [int(s) for s in group_sizes.split(",")] if group_sizes else None
        s_model = load_model(sender.path, device=device, dtype=dtype)
        r_model = load_model(receiver.path, device=device, dtype=dtype)
        translator = translate.load(translator_path, translator_sha256) if translator_path else None
    except (DroidMeshError, ValueError) as e:  # a bad dataset, task, device, group size or translator: one line
        raise click.UsageError(str(e)) from None
    if translator is not None:
        try:
            ev = evaluate_translated(s_model, r_model, translator, rows, spec, ks=sizes or (1, 2))
        except DroidMeshError as e:  # a translator for other models
            raise click.UsageError(str(e)) from None
        table = format_translated(ev)
    else:
        ev = evaluate_pair(s_model, r_model, rows, spec, group_sizes=sizes, group_stride=group_stride,
                           layer_stride=layer_stride, keep_predictions=predictions)
        table = format_table(ev)
    ev.update({"sender": sender.label, "receiver": receiver.label, "split": split, "data": data_path or "zoo"})
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(ev, indent=2) + "\n")
    click.echo(table)


def format_table(ev: dict) -> str:
    """A short text table of the headline paths and the must-show summary."""
    fp = ev["receiver_full_prefill"]["quality"]
    lines = [f"{ev['task']} ({ev['metric']}, {ev['rows']} rows, {ev['total_layers']} layers)",
             f"{'path':28s} {'quality':>8s} {'nll':>8s} {'kl':>8s} {'top1':>6s} {'greedy':>6s}  "
             "vs full prefill, 95 % interval"]
    def row(name, r):
        return (f"{name:28s} {r['quality']:8.4f} {r['answer_nll']:8.4f} {r['kl']:8.4f} {r['top1_agreement']:6.3f} "
                f"{r.get('greedy_agreement', float('nan')):6.3f}  {versus_text(r.get('vs_full_prefill'))}")
    lines += [row("sender alone", ev["sender_alone"]), row("receiver full prefill", ev["receiver_full_prefill"]),
              row("receiver full reuse", ev["receiver_full_reuse"])]
    lines += [row(f"reuse only layer {p['layer']}", p) for p in ev["per_layer_reuse"]]
    lines += [row(f"recompute [{g['start']},{g['end']})", g) for g in ev["best_groups"]]
    s = ev["summary"]
    lines.append(f"full reuse loses {s['full_reuse_relative_loss']:.1%} of {fp:.4f}; critical layers {s['critical_layers']} "
                 f"({s['critical_fraction']:.0%}); smallest restoring group {s['smallest_restoring_group']}")
    return "\n".join(lines)

