"""`droidmesh eval`: quality of a sender -> receiver pair under each KV-reuse path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import click

from droidmesh.shared.tasks.intervals import versus_text
from droidmesh.shared.tasks.realtext import SPLITS
from droidmesh.shared.tasks.spec import METRIC_NAMES
from droidmesh.shared.tools.cli.model_options import MODEL_HELP, device_options, model_arg
from droidmesh.shared.tools.cli.params import GROUP, check_group


@click.command("eval")
@click.option("--sender", required=True, callback=model_arg, help=f"Sender: {MODEL_HELP}.")
@click.option("--receiver", required=True, callback=model_arg, help=f"Receiver: {MODEL_HELP}.")
@click.option("--task", required=True, help="multihop_qa | summarization | code_completion (or a name for --data).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True,
              help="heldout: the real Python tasks' third pool of sources (the stdlib's packages), for verdicts.")
@click.option("--data", "data_path", type=click.Path(exists=True, dir_okay=False),
              help="A LongBench-style JSONL dataset instead of the zoo's generated split.")
@click.option("--metric", type=click.Choice(METRIC_NAMES), default=None,
              help="Metric for a --data task the zoo does not know (default f1).")
@click.option("--n", "n_rows", type=click.IntRange(1, 100000), default=None, help="Rows to evaluate (default: the tier's).")
@click.option("--group-sizes", default=None, help="Comma-separated recompute-group sizes (default: all).")
@click.option("--groups", "explicit_groups", type=GROUP, multiple=True,
              help="Exactly this recompute group, START:END; repeat for more (instead of every group of --group-sizes).")
@click.option("--group-stride", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Groups start every N layers (the topmost start is always included).")
@click.option("--layer-stride", type=click.IntRange(0, 1000), default=1, show_default=True,
              help="Per-layer probes every N layers; 0: none (each recomputes all but one layer).")
@device_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write the eval JSON here.")
@click.option("--predictions", is_flag=True, help="Include per-row predictions in the JSON.")
@click.option("--per-row", is_flag=True, help="Include every row's figures in the JSON (needed to merge shards).")
@click.option("--shard", callback=lambda c, p, v: _shard(v), default=None,
              help="K/N: score only rows K, K+N, K+2N, ... (implies --per-row); `droidmesh eval-merge` joins the N.")
@click.option("--no-sender-alone", is_flag=True, help="Skip the sender answering alone (one prefill a row less).")
@click.option("--wire", "wire_names", type=click.Choice(("int8", "int4", "int4-g64-e-int8")), multiple=True,  # layer_codecs.WIRES
              help="Also score full reuse and each group with every reused layer sent under this codec "
                   "(int4-g64-e-int8: int4 in groups of 64, the group start's E int8), beside the plan raw; repeatable.")
@click.option("--jobs", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Score with this many processes, one thread each (one per core), in parts of 25 rows kept "
                   "as they finish: the same command run again after a stop scores only the missing parts.")
@click.option("--parts", "parts_dir", type=click.Path(file_okay=False), default=None,
              help="Where --jobs keeps its parts until they are merged (default: <--json>.parts).")
@click.option("--translator", "translator_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A translated pair (models of other sizes, families or tokenizers): the translator file "
                   "`droidmesh profile --translate` wrote; scores translated KV instead of reused KV.")
@click.option("--translator-sha256", default=None, help="Refuse the translator unless its file has this sha256.")
def eval_cmd(sender, receiver, task: str, split: str, data_path: str | None, metric: str | None,
             n_rows: int | None, group_sizes: str | None, group_stride: int, layer_stride: int, device: str,
             dtype: str | None, json_path: str, predictions: bool, per_row: bool, shard: tuple[int, int] | None,
             no_sender_alone: bool, wire_names: tuple[str, ...], explicit_groups: tuple[tuple[int, int], ...],
             jobs: int, parts_dir: str | None, translator_path: str | None, translator_sha256: str | None) -> None:
    """Score sender alone, receiver full prefill, full reuse, per-layer reuse and best groups
    (with --translator: receiver full prefill, translated, translated with layers [0, k)
    recomputed, the receiver without the context, and the prefill cost saved)."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.kv import translate
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tasks.spec import task_spec

    _check_usage(translated=translator_path is not None, reused_only=bool(shard or explicit_groups or no_sender_alone
                 or per_row or wire_names or jobs > 1), both_shardings=jobs > 1 and shard is not None,
                 both_groupings=bool(explicit_groups and group_sizes))
    spec = task_spec(task, metric=metric)
    try:
        data_sha256 = hashlib.sha256(Path(data_path).read_bytes()).hexdigest() if data_path else None  # the rows scored
        rows = _rows(task, split, data_path, receiver, n_rows)
        total = len(rows)
        index = list(range(total))[shard[0]::shard[1]] if shard else None
        rows = [rows[i] for i in index] if index is not None else rows
        sizes = [int(s) for s in group_sizes.split(",")] if group_sizes else None
        s_model = load_model(sender.path, device=device, dtype=dtype)
        r_model = load_model(receiver.path, device=device, dtype=dtype)
        translator = translate.load(translator_path, translator_sha256) if translator_path else None
    except (DroidMeshError, ValueError) as e:  # a bad dataset, task, device, group size or translator: one line
        raise click.UsageError(str(e)) from None
    stamp = _stamp(sender, receiver, split, data_path, data_sha256, dtype)
    if translator is not None:
        ev, table = _translated(s_model, r_model, translator, rows, spec, sizes)
    else:
        for group in explicit_groups:
            check_group(group, r_model.num_layers, "--groups")
        options = {"group_sizes": sizes, "group_stride": group_stride, "layer_stride": layer_stride,
                   "groups": list(explicit_groups) or None, "sender_alone": not no_sender_alone,
                   "keep_predictions": predictions}
        if jobs > 1:
            models = [s_model, r_model]
            del s_model, r_model  # `_in_parts` lets go of them before its processes load their own
            ev = _in_parts(models, rows, spec, wire_names, options, stamp, jobs, device, parts_dir or f"{json_path}.parts",
                           keep_rows=per_row, paths=(str(sender.path), str(receiver.path)))
        else:
            ev = _reused(s_model, r_model, rows, spec, wire_names, keep_rows=per_row or shard is not None,
                         row_index=index, **options)
        table = format_table(ev)
        if "per_row" in ev:
            ev["per_row"]["of"] = total  # the whole row list's length: a merge checks its shards cover it
    ev.update(stamp)
    if shard:
        ev["shard"] = f"{shard[0]}/{shard[1]}"
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(ev, indent=2) + "\n")
    click.echo(table)


@click.command("eval-merge")
@click.argument("parts", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write the merged eval here.")
@click.option("--incomplete", is_flag=True, help="Merge shards that do not cover their row list (the result says so).")
@click.option("--no-figures", is_flag=True,
              help="Print only how many rows were merged, not the figures: for joining a run's rows (e.g. "
                   "`bench vllm-rows --beside`) before the row count its verdict is read at.")
def eval_merge(parts: tuple[str, ...], json_path: str, incomplete: bool, no_figures: bool) -> None:
    """Join the evals of `droidmesh eval --shard K/N` (or --per-row evals of disjoint rows of one
    list) into the eval of all their rows, intervals recomputed over every row."""
    from droidmesh.shared.tasks.evaluation import merge

    try:
        ev = merge([json.loads(Path(p).read_text()) for p in parts], incomplete_ok=incomplete)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:  # not evals of ours, or not shards of one
        raise click.UsageError(f"cannot merge {len(parts)} evals: {e}") from None
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(ev, indent=2) + "\n")
    if "incomplete" in ev:
        click.echo(f"incomplete: {ev['incomplete']['rows']} rows of {ev['incomplete']['of'] or 'an unknown number'}")
    if no_figures:
        click.echo(f"merged {ev['rows']} rows into {json_path} (figures not shown)")
    else:
        click.echo(format_table(ev))


def _stamp(sender: Any, receiver: Any, split: str, data_path: str | None, data_sha256: str | None, dtype: str | None
           ) -> dict[str, Any]:
    """What names an eval in its JSON (and what `eval-merge` compares across shards)."""
    return {"sender": sender.label, "receiver": receiver.label, "split": split, "data": data_path or "zoo",
            "data_sha256": data_sha256, "dtype": dtype}


def _translated(s_model: Any, r_model: Any, translator: Any, rows: list[dict], spec: Any, sizes: list[int] | None
                ) -> tuple[dict[str, Any], str]:
    """The translated eval and its table; a translator for other models is a usage error."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.profiling.job import format_translated
    from droidmesh.shared.tasks.translated import evaluate_translated

    try:
        ev = evaluate_translated(s_model, r_model, translator, rows, spec, ks=sizes or (1, 2))
    except DroidMeshError as e:
        raise click.UsageError(str(e)) from None
    return ev, format_translated(ev)


def _check_usage(*, translated: bool, reused_only: bool, both_shardings: bool, both_groupings: bool) -> None:
    if translated and reused_only:
        raise click.UsageError("--shard, --groups, --no-sender-alone, --per-row, --wire and --jobs are for reused KV, "
                               "not --translator")
    if both_shardings:
        raise click.UsageError("--jobs or --shard, not both (--jobs shards the rows itself)")
    if both_groupings:
        raise click.UsageError("--groups or --group-sizes, not both")


def _reused(s_model: Any, r_model: Any, rows: list[dict], spec: Any, wire_names: tuple[str, ...], **options: Any
            ) -> dict[str, Any]:
    """`evaluate_pair`, with each named wire (`layer_codecs.named_wire`) scored beside its plan raw."""
    from droidmesh.shared.tasks.evaluation import evaluate_pair
    from droidmesh.shared.tools.apps.eval_parts import wire_makers

    try:
        return evaluate_pair(s_model, r_model, rows, spec, wires=wire_makers(wire_names, s_model, r_model), **options)
    except ValueError as e:  # a wire this model's head dim cannot carry
        raise click.UsageError(str(e)) from None


def _in_parts(models: list[Any], rows: list[dict], spec: Any, wire_names: tuple[str, ...], options: dict[str, Any],
              stamp: dict[str, Any], jobs: int, device: str, parts: str, *, keep_rows: bool, paths: tuple[str, str]
              ) -> dict[str, Any]:
    """`eval_parts.run` over checkpoints `paths`, after the wires are built once on `models` (a head
    dim one cannot carry is a usage error before any process starts), which are then let go."""
    import gc

    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.tools.apps import eval_parts

    try:
        for make in eval_parts.wire_makers(wire_names, *models).values():
            make(ReusePlan.full_reuse())
        models.clear()
        gc.collect()
        job = eval_parts.Job(*paths, spec, device, stamp["dtype"], wire_names, options, stamp)
        named = {"models": paths, "task": spec.name, "metric": spec.metric, "rows": len(rows), "device": device,
                 "options": options, "wires": list(wire_names), **stamp}  # what a kept part must have been scored with
        ev = eval_parts.run(job, rows, jobs, Path(parts), named)
    except (ValueError, DroidMeshError) as e:
        raise click.UsageError(str(e)) from None
    if not keep_rows:
        ev.pop("per_row")
    return ev


def _rows(task: str, split: str, data_path: str | None, receiver, n_rows: int | None) -> list[dict]:
    """The first `n_rows` of a user's JSONL, or of the zoo's `split` of `task` (the tier's count)."""
    from droidmesh.shared.tasks.jsonl import read_jsonl
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.zoo.tiers import TIERS, get_recipe

    if data_path is not None:
        rows = read_jsonl(data_path)
    else:
        recipe = get_recipe(receiver.tier) if receiver.tier in TIERS else None
        rows = make_rows(task, split, n_rows or (recipe.eval_rows if recipe else 48), recipe.suite if recipe else SuiteShape())
    return rows[:n_rows] if n_rows else rows


def _shard(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        k, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected K/N") from None
    if not 0 <= k < n:
        raise click.BadParameter(f"{value!r}: needs 0 <= K < N")
    return k, n


def _plan_label(path: str) -> str:
    """"recompute [s,e)" for "group/s/e", "full reuse" for "receiver_full_reuse"."""
    if path.startswith("group/"):
        _, start, end = path.split("/")
        return f"recompute [{start},{end})"
    return path.removeprefix("receiver_").replace("_", " ")


def format_table(ev: dict) -> str:
    """A short text table of the headline paths and the must-show summary."""
    fp = ev["receiver_full_prefill"]["quality"]
    lines = [f"{ev['task']} ({ev['metric']}, {ev['rows']} rows, {ev['total_layers']} layers)",
             f"{'path':28s} {'quality':>8s} {'nll':>8s} {'kl':>8s} {'top1':>6s} {'greedy':>6s}  "
             "vs full prefill, 95 % interval"]
    def row(name, r):
        return (f"{name:28s} {r['quality']:8.4f} {r['answer_nll']:8.4f} {r['kl']:8.4f} {r['top1_agreement']:6.3f} "
                f"{r.get('greedy_agreement', float('nan')):6.3f}  {versus_text(r.get('vs_full_prefill'))}"
                + (f"; by source {versus_text(r['vs_full_prefill_by_source'])}" if "vs_full_prefill_by_source" in r else ""))
    lines += [row("sender alone", ev["sender_alone"])] if ev["sender_alone"] else []
    lines += [row("receiver full prefill", ev["receiver_full_prefill"]), row("receiver full reuse", ev["receiver_full_reuse"])]
    lines += [row(f"reuse only layer {p['layer']}", p) for p in ev["per_layer_reuse"]]
    lines += [row(f"recompute [{g['start']},{g['end']})", g) for g in ev["best_groups"]]
    lines += [row(f"{_plan_label(c['path'])} @{c['wire']}", c) + f"; vs raw {versus_text(c['vs_raw'])}, "
              f"{c['rows_changed']} rows changed" for c in ev.get("coded", [])]
    s = ev["summary"]
    lines.append(f"full reuse loses {s['full_reuse_relative_loss']:.1%} of {fp:.4f}; critical layers {s['critical_layers']} "
                 f"({s['critical_fraction']:.0%}); smallest restoring group {s['smallest_restoring_group']}")
    return "\n".join(lines)

