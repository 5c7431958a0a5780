"""`droidmesh bench ...`: benchmark suites (tables on stdout, JSON and plots on request)."""

from __future__ import annotations

import click
import torch

from shared.bench import report

# Before the zoo's demo tier exists, latency runs on a random-init 12-layer model of this shape.
RANDOM_BENCH_MODEL = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=6,
    num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192,
)


def _int_list(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from e
    if not out or min(out) < 1:
        raise click.BadParameter("need at least one positive integer")
    return out


@click.group()
def bench() -> None:
    """Benchmark suites: each prints a table and writes --json (and --plot where it plots)."""


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows and machine info here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a speedup-vs-k PNG here.")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False),
              help="Local HF checkpoint (default: a random-init 12-layer Llama).")
@click.option("--contexts", default="1024,2048,4096", callback=_int_list, show_default=True,
              help="Context lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16"]), show_default=True)
@click.option("--threads", default=None, type=click.IntRange(1, 256), help="torch threads (default: torch's).")
def ttft(json_path, plot_path, model_path, contexts, repeats, dtype, threads) -> None:  # type: ignore[no-untyped-def]
    """Receiver TTFT: full prefill vs full reuse vs partial prefill with k layers recomputed."""
    from shared.bench import ttft as suite
    from shared.model.adapter import load_model, random_model

    if threads:
        torch.set_num_threads(threads)
    if model_path:
        model = load_model(model_path, dtype=dtype)
    else:
        click.echo("no --model given: using a random-init 12-layer Llama (latency only, no quality)", err=True)
        model = random_model("llama", dtype=dtype, name="random-llama-12L", **RANDOM_BENCH_MODEL)
    rows = suite.measure(model, contexts, repeats)
    cols = ["context_tokens", "mode", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal_speedup"]
    click.echo(report.format_table(rows, cols))
    report.write_json(json_path, {"suite": "ttft", "machine": report.machine(), "model": report.model_record(model),
                                  "rows": rows})
    if plot_path:
        suite.plot(rows, plot_path)
