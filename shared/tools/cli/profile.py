"""`droidmesh profile`: offline profile of a sender -> receiver pair (optionally published).

The command parses its options into a `ProfileJob` and hands it to the library
(`shared/profiling/job.py`), which profiles, writes the files and words the summary; here the
library's errors become usage errors, the lines are echoed, and `--publish` puts the config (or
the translator) on the NATS server, blocking on `conn.run` until it is stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from droidmesh.shared.profiling.job import DEFAULT_BUDGET_MIN, ProfileJob
from droidmesh.shared.tasks.spec import METRIC_NAMES
from droidmesh.shared.tools.cli.connect import Conn, nats_options
from droidmesh.shared.tools.cli.model_options import MODEL_HELP, device_options, model_arg

if TYPE_CHECKING:
    from droidmesh.shared.wire import schemas


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
@click.option("--search", "search_kind", type=click.Choice(["guided", "coarse", "fidelity"]), default="guided",
              show_default=True,
              help="guided: sensitivity pass + one window per group size, O(L) plans; coarse: a 4-block grid, "
                   "then binary search on the group's ends, O(log L) plans; fidelity: plans ranked by their "
                   "divergence from full prefill, the short list raced on the task metric with 95 % intervals "
                   "(rows a plan cannot win on are not spent on it).")
@click.option("--max-layers", type=click.IntRange(1, 4096), default=None, metavar="N",
              help="--search fidelity: recompute no more than N layers (the prefill share you need saved); when no "
                   "group that small removes half of full reuse's divergence, the closest is raced anyway, with a "
                   "warning.")
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
              help="A translated pair (another size, family or tokenizer): fit the translator on the contexts of "
                   "--n-train train rows, write it to translators/<pair>.safetensors next to the JSON, score it on --n-test.")
@click.option("--candidates", default=None, type=click.IntRange(1, 64), metavar="N",
              help="--translate: the lowest N source layers the translator may read (default 8). The fit holds "
                   "float64 statistics of 2 * N * source-hidden features: fewer for wide models.")
@device_options
@click.option("--publish", is_flag=True,
              help="Also publish the config to the bucket of the NATS server --nats names (role profiler or admin).")
@nats_options(default_timeout=30.0)
def profile(translate: bool, candidates: int | None, publish: bool, conn: Conn, **options: Any) -> None:
    """Find the pair's recompute group: sensitivity, searches, Pareto frontier, chosen config.

    Says its estimated cost on stderr before it starts (one row-evaluation timed, times the
    plans and rows it will score); `--budget` (an hour unless told) cuts the work to fit, or refuses. Fails before
    the search on rows where the receiver's full prefill scores near 0 or every path alike.
    Warns (stderr, and `sample_warning` in the JSON) when the sample is too small for the
    choice to mean anything: fewer than 20 test rows, or full reuse losing less than the
    sampling noise 1/sqrt(test rows) against full prefill on the test split; and when the
    chosen group fails the tolerance rule on the test split (then publishing needs --force)."""
    from droidmesh.shared.errors import DroidMeshError, NoSignalError
    from droidmesh.shared.profiling import evidence
    from droidmesh.shared.profiling.job import run_job, summary_lines

    job = ProfileJob(**options)
    if translate:
        _profile_translated(job, candidates, conn if publish else None)
        return
    try:
        result, cfg, maps = run_job(job, say=lambda line: click.echo(line, err=True))
    except NoSignalError:  # the rows, not the arguments: `Error: ...`, exit 1
        raise
    except DroidMeshError as e:  # bad arguments (an unknown --other-task, a bad JSONL row, no GPU, --budget): one line
        raise click.UsageError(str(e)) from None
    for line in summary_lines(job, result):
        click.echo(line)
    if publish:  # the JSON is written: the user may still publish it, knowingly
        evidence.check_publishable(cfg, "not published", f"publish {job.json_path} anyway with "
                                   "`droidmesh config publish --force`")
    if publish:
        _publish(conn, cfg, maps)
        click.echo(f"  published {job.pair.versioned(cfg.profile_version)}")


def _publish(conn: Conn, cfg: schemas.RecomputeConfig, maps: dict[str, bytes]) -> None:
    """The config to the config board, after the maps files it names (a receiver that sees the
    config can fetch its maps)."""
    from droidmesh.shared.mesh.config_board import NatsConfigBoard, validate
    from droidmesh.shared.mesh.maps_store import NatsMapsStore, referenced

    board_cfg = validate(cfg)
    files = [maps[sha] for sha in sorted(referenced(board_cfg.frontier))]

    async def put(nc: Any) -> None:
        store = NatsMapsStore(nc)
        for data in files:
            await store.put(data)
        await NatsConfigBoard(nc).put(board_cfg)

    conn.run(put, "publishing the config")


def _profile_translated(job: ProfileJob, candidates: int | None, publish: Conn | None) -> None:
    """`--translate`: the translator is the translated pair's profile (zoo task rows); with
    `--publish` the file goes to the maps bucket, where receivers fetch it by its sha256."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.profiling.job import run_translated, translated_lines

    try:
        result = run_translated(job, candidates)
    except (DroidMeshError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    for line in translated_lines(job, result):
        click.echo(line)
    if publish is not None:
        from droidmesh.shared.mesh.maps_store import NatsMapsStore

        data = (job.translators_dir / result["translator_file"]).read_bytes()

        async def put(nc: Any) -> None:
            await NatsMapsStore(nc).put(data)

        publish.run(put, "publishing the translator")
        click.echo(f"  published translator {result['translator_sha256']} (receivers: --translators "
                   f"{result['translator_sha256']})")
