"""`droidmesh profile`: offline profile of a sender -> receiver pair (optionally published)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from droidmesh.shared.tasks.spec import METRIC_NAMES
from droidmesh.shared.tools.cli.connect import Conn, nats_options
from droidmesh.shared.tools.cli.model_options import MODEL_HELP, device_options, model_arg

# When a profile's choice means nothing: fewer test rows than this, or a gap between full prefill
# and full reuse (test split) below the sampling noise 1/sqrt(n) -- two standard errors of the mean
# of a metric in [0, 1] at its worst-case variance (0.25). Below it the sample cannot tell full
# reuse from full prefill, so which group "restores" quality is not supported by the data.
MIN_TEST_ROWS = 20
# `droidmesh profile` fits this many minutes unless told otherwise (`--budget 0`: no limit). The
# whole profile of a 30-layer real model on a CPU core is hours (4 h 19 min for SmolLM2-135M on
# 50 + 50 QA rows); a default that starts a job of that size unasked is one nobody wants, and an
# hour is what a person leaves a profile running for before coming back to it.
DEFAULT_BUDGET_MIN = 60.0


def sample_warning(result: dict, n_test_rows: int) -> str | None:
    """Why the profile's choice is not meaningful, or None when the sample supports it."""
    noise = 1 / max(1, n_test_rows) ** 0.5
    gap = result["full_prefill"]["quality_test"] - result["full_reuse"]["quality_test"]
    if n_test_rows < MIN_TEST_ROWS:
        return f"only {n_test_rows} test rows (< {MIN_TEST_ROWS}): the chosen group is not meaningful; use more rows"
    if gap < noise:
        return (f"full reuse loses {gap:.3f} on the test split, below the sampling noise 1/sqrt({n_test_rows}) = "
                f"{noise:.3f}: the sample cannot tell which layers matter; use more rows")
    return None


def test_rule_warning(result: dict) -> str | None:
    """Why the chosen plan must not be published as it is, or None when it holds on the test split."""
    ch, fp, tol = result["chosen"], result["full_prefill"], result["tolerance"]
    if ch.get("passes_test", True):
        return None
    return (f"the chosen group fails the {tol:.0%} rule on the test split: test {ch['quality_test']:.3f} < "
            f"{1 - tol:g} x full prefill {fp['quality_test']:.3f}; `droidmesh config publish` refuses it without --force")


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
@click.option("--search", "search_kind", type=click.Choice(["guided", "coarse"]), default="guided", show_default=True,
              help="guided: sensitivity pass + one window per group size, O(L) plans; coarse: a 4-block grid, "
                   "then binary search on the group's ends, O(log L) plans.")
@click.option("--exhaustive/--guided-only", default=False, show_default=True,
              help="Also run the O((L/g)^2) search to compare with the chosen one (120 more plans at 30 layers, g=2).")
@click.option("--budget", type=click.FloatRange(0), default=DEFAULT_BUDGET_MIN, show_default=True,
              metavar="MINUTES",
              help="Fit the profile in this many minutes (measured before it starts): drop the exhaustive "
                   "comparison, robustness, the guided search for the coarse one, the transfer search, then rows; "
                   "refuse when even that does not fit. 0: no limit (every row and search asked for).")
@click.option("--allow-no-signal", is_flag=True,
              help="Write a profile even where the rows cannot support a choice (the receiver's full prefill "
                   "scores near 0, or every path alike): untrained plumbing models only.")
@click.option("--robustness/--no-robustness", default=True, show_default=True,
              help="Apply the chosen config to the test split of other tasks (does the choice transfer?).")
@click.option("--other-task", "other_tasks", multiple=True,
              help="A zoo task or shift (e.g. multihop_qa/long), or a JSONL file, to check robustness on "
                   "(repeatable; default: for a zoo task, its shifts and every other zoo task).")
@click.option("--transfer/--no-transfer", "transfer_search", default=True, show_default=True,
              help="Also search how the chosen plan's tensors travel (raw, int8, int4, SCD lowrank codes and "
                   "patch layers); the lowrank maps files are written to maps/ next to the JSON.")
@click.option("--translate", is_flag=True,
              help="A translated pair (another size, family or tokenizer): fit the translator on --n-train train "
                   "contexts, write it to translators/<pair>.safetensors next to the JSON, score it on --n-test.")
@click.option("--candidates", default=None, type=click.IntRange(1, 64), metavar="N",
              help="--translate: the lowest N source layers the translator may read (default 8). The fit holds "
                   "float64 statistics of 2 * N * source-hidden features: fewer for wide models.")
@device_options
@click.option("--publish", is_flag=True,
              help="Also publish the config to the bucket of the NATS server --nats names (role profiler or admin).")
@nats_options(default_timeout=30.0)
def profile(sender, receiver, task, json_path, plot_path, n_train, n_test, data, data_train, data_test, metric,
            max_new_tokens, stop, granularity, tolerance, search_kind, exhaustive, budget, allow_no_signal, robustness,
            other_tasks, transfer_search, translate, candidates, device, dtype, publish: bool, conn: Conn) -> None:
    """Find the pair's recompute group: sensitivity, searches, Pareto frontier, chosen config.

    Says its estimated cost on stderr before it starts (one row-evaluation timed, times the
    plans and rows it will score); `--budget` (an hour unless told) cuts the work to fit, or refuses. Fails before
    the search on rows where the receiver's full prefill scores near 0 or every path alike.
    Warns (stderr, and `sample_warning` in the JSON) when the sample is too small for the
    choice to mean anything: fewer than 20 test rows, or full reuse losing less than the
    sampling noise 1/sqrt(test rows) against full prefill on the test split; and when the
    chosen group fails the tolerance rule on the test split (then publishing needs --force)."""
    from droidmesh.shared.errors import BadRequestError, DroidMeshError, NoSignalError
    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.profiling import cost
    from droidmesh.shared.profiling.plot import frontier_png, transfer_png
    from droidmesh.shared.profiling.profile import ProfileSettings, profile_checkpoints
    from droidmesh.shared.tasks.jsonl import read_jsonl

    if translate:
        _profile_translated(sender, receiver, task, json_path, n_train, n_test, device, dtype, conn if publish else None,
                            candidates)
        return
    settings = ProfileSettings(granularity=granularity, tolerance=tolerance, search=search_kind, exhaustive=exhaustive,
                               require_signal=not allow_no_signal, budget_s=budget * 60 if budget else None)
    maps: dict[str, bytes] = {}  # sha256 -> SCD maps file
    try:
        for path in (data, data_train, data_test):  # a bad file fails now, not after the models load
            if path:
                read_jsonl(path)
        result, cfg = profile_checkpoints(sender, receiver, task, settings, n_train=n_train, n_test=n_test, data=data,
                                          data_train=data_train, data_test=data_test, metric=metric,
                                          max_new_tokens=max_new_tokens, stop=tuple(stop) or None, device=device,
                                          dtype=dtype, other_tasks=(list(other_tasks) or None) if robustness else [],
                                          transfer_search=transfer_search, maps_out=maps,
                                          say=lambda line: click.echo(line, err=True))
    except NoSignalError:  # the rows, not the arguments: `Error: ...`, exit 1
        raise
    except DroidMeshError as e:  # bad arguments (an unknown --other-task, a bad JSONL row, no GPU, --budget): one line
        raise click.UsageError(str(e)) from None
    # Which weights were profiled, so `droidmesh config publish` binds the file to exactly them.
    # A checkpoint path is recorded absolute: `config publish` may run from another directory.
    result["models"] = {role: ref.label if ref.tier else str(Path(ref.path).resolve())
                        for role, ref in (("sender", sender), ("receiver", receiver))}
    result["models"].update(sender_sha256=sender.sha256, receiver_sha256=receiver.sha256)
    result["sample_warning"] = sample_warning(result, result["rows"]["test"])
    for warning in (result["sample_warning"], test_rule_warning(result)):
        if warning:
            click.echo(f"warning: {warning}", err=True)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    for sha, data in maps.items():  # named as the JSON's transfer configs name them (maps_file)
        (Path(json_path).parent / "maps").mkdir(exist_ok=True)
        (Path(json_path).parent / "maps" / f"{sha}.safetensors").write_bytes(data)
    if plot_path:
        frontier_png(result, plot_path, result["evaluated"])
        if "transfer" in result:
            transfer_png(result, str(Path(plot_path).with_name(Path(plot_path).stem + "-transfer.png")))
    pair = Pair(sender.name, receiver.name)
    ch, fp, fr = result["chosen"], result["full_prefill"], result["full_reuse"]
    click.echo(f"{pair.id} on {task} ({result['total_layers']} layers)")
    click.echo(f"  full prefill  train {fp['quality_train']:.3f}  test {fp['quality_test']:.3f}")
    click.echo(f"  full reuse    train {fr['quality_train']:.3f}  test {fr['quality_test']:.3f}")
    click.echo(f"  chosen [{ch['start']},{ch['end']}) ({ch['recomputed_layers']} layers)  "
               f"train {ch['quality_train']:.3f}  test {ch['quality_test']:.3f}  "
               + ("holds on test" if ch["passes_test"] else "FAILS on test"))
    sc = result["scattered_critical"]
    if sc is not None:  # a coarse search runs no sensitivity pass
        click.echo(f"  critical layers {result['critical_layers']}  recomputed alone: train {sc['quality_train']:.3f}"
                   f"  test {sc['quality_test']:.3f}")
    sp = result["chosen_split"]
    click.echo(f"  chosen layers as {len(sp['groups'])} one-layer groups ({sp['e_transitions']} E transitions): "
               f"train {sp['quality_train']:.3f}  test {sp['quality_test']:.3f}")
    ev, kind = result["evaluations"], result["search"]
    click.echo(f"  {kind} search: {ev[kind]} configs + {ev['sensitivity']} sensitivity"
               + (f"; agrees with the exhaustive one ({ev['exhaustive']} configs): {result['searches_agree']}"
                  if ev["exhaustive"] else "")
               + f"; {cost.duration(result['cost']['elapsed_s'])} (estimated {cost.duration(result['cost']['estimated_s'])})")
    for r in result["robustness"]:
        click.echo(f"  robustness {r['task']:<22} full prefill {r['full_prefill']:.3f}  chosen {r['chosen']:.3f}  "
                   f"difference {r['difference']:+.3f}"
                   + (f" ({r['relative']:+.1%})" if r["relative"] is not None else " (receiver scores 0 here)"))
    if "transfer" in result:
        _echo_transfer(result["transfer"])
    if publish and cfg.passes_test is False:  # the JSON is written: the user may still publish it, knowingly
        raise BadRequestError(f"not published: the chosen group fails the test split; publish {json_path} anyway "
                              "with `droidmesh config publish --force`")
    if publish:
        from droidmesh.shared.mesh.config_board import NatsConfigBoard, validate
        from droidmesh.shared.mesh.maps_store import NatsMapsStore, referenced

        board_cfg = validate(cfg)
        files = [maps[sha] for sha in sorted(referenced(board_cfg.frontier))]

        async def put(nc: Any) -> None:
            store = NatsMapsStore(nc)
            for data in files:  # first: a receiver that sees the config can fetch its maps
                await store.put(data)
            await NatsConfigBoard(nc).put(board_cfg)

        conn.run(put, "publishing the config")
        click.echo(f"  published {pair.versioned(cfg.profile_version)}")


def _profile_translated(sender, receiver, task: str, json_path: str, n_train: int, n_test: int, device: str,
                        dtype: str | None, publish: Conn | None, candidates: int | None = None) -> None:
    """`--translate`: the translator is the translated pair's profile (zoo task rows); with
    `--publish` the file goes to the maps bucket, where receivers fetch it by its sha256."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.profiling.translate_fit import profile_translated
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.cli.eval import format_translated

    pair = Pair(sender.name, receiver.name)
    out = Path(json_path)
    try:
        spec = task_spec(task)
        train = [r["context"] for r in make_rows(task, "train", n_train, SuiteShape())]
        test = make_rows(task, "test", n_test, SuiteShape())
        source = load_model(sender.path, device=device, dtype=dtype)
        target = load_model(receiver.path, device=device, dtype=dtype)
        result = profile_translated(source, target, train, test, spec, out.parent / "translators" / f"{pair.id}.safetensors",
                                    weights=(sender.sha256, receiver.sha256),
                                    **({"candidates": candidates} if candidates else {}))
    except (DroidMeshError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    result["models"] = {"sender": sender.label, "receiver": receiver.label, "sender_sha256": sender.sha256,
                        "receiver_sha256": receiver.sha256}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    info = result["translator"]
    click.echo(f"{pair.id} on {task}: translator fit on {info['contexts']} contexts ({info['tokens']} tokens) in "
               f"{result['fit_s']:.1f}s, {result['translator_bytes'] / 1e6:.2f} MB, sha256 {result['translator_sha256'][:16]}")
    click.echo(format_translated(result))
    if publish is not None:
        from droidmesh.shared.mesh.maps_store import NatsMapsStore

        data = (out.parent / "translators" / result["translator_file"]).read_bytes()

        async def put(nc: Any) -> None:
            await NatsMapsStore(nc).put(data)

        publish.run(put, "publishing the translator")
        click.echo(f"  published translator {result['translator_sha256']} (receivers: --translators "
                   f"{result['translator_sha256']})")


def _echo_transfer(t: dict[str, Any]) -> None:
    """The transfer search's table: per config, bytes, quality, and where it is the fastest."""
    cal, tokens = t["calibration"], max(t["tokens"])
    click.echo(f"  transfer search (maps fitted on {cal['contexts']} contexts, {cal['tokens']} tokens, "
               f"{cal['fit_s']:.1f}s; predicted TTFT at {tokens} tokens, Gbit/s "
               + " / ".join(f"{r:g}" for r in t["link_gbit_s"]) + ")")
    for c in t["configs"]:
        ttft = " / ".join(f"{s * 1e3:.0f}" for s in c["predicted_ttft_s"][str(tokens)].values())
        fastest = [r for r, per in t["chosen_by_link"].items() if per[str(tokens)] == c["name"]]
        click.echo(f"    {c['name']:<34} {c['wire_bytes_per_token']:>6} B/token ({c['bytes_ratio']:.2f} of raw)  "
                   f"train {c['quality_train']:.3f}  test {c['quality_test']:.3f}  "
                   f"{'meets' if c['meets_rule'] else 'fails'}  TTFT ms {ttft}"
                   + (f"  fastest at {', '.join(fastest)} Gbit/s" if fastest else ""))
