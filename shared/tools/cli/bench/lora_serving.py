"""`droidmesh bench adapters`: many LoRA adapters served from one base in one process, against
one process per merged adapter.
"""

from __future__ import annotations

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.model_options import device_options
from droidmesh.shared.tools.cli.params import int_list


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows and prefill timings here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the memory / prefill PNG here.")
@click.option("--base", "base_arg", default="real/base", show_default=True,
              help="The base model: a zoo name as `droidmesh zoo list` prints it, or a checkpoint directory.")
@click.option("--adapters", "adapter_args", default="real/docqa,real/summ,real/code", show_default=True,
              help="Comma list of PEFT adapters of the base (zoo names or directories); the first is the one merged "
                   "and timed.")
@click.option("--counts", default="1,2,4", show_default=True, callback=int_list,
              help="Adapters per set; beyond those given, random LoRAs of the first one's shapes are made.")
@click.option("--tokens", default=1024, show_default=True, type=click.IntRange(16, 32768), help="Timed prefill length.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50), help="Timed prefills (median).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, 256),
              help="torch threads (OMP_NUM_THREADS) of each measured process.")
@device_options
def adapters(json_path, plot_path, base_arg, adapter_args, counts, tokens, repeats, threads, device, dtype) -> None:
    """Resident memory of N fine-tunes as merged models vs as adapters over one base (each layout in
    its own process), and the unmerged LoRA's prefill overhead."""
    from droidmesh.shared.tools.bench import lora_serving as suite
    from droidmesh.shared.zoo.manifest import resolve_model

    if min(counts) < 1:
        raise click.BadParameter(f"counts must be >= 1, got {counts}", param_hint="'--counts'")
    try:
        base = resolve_model(base_arg)
        refs = [resolve_model(a.strip()) for a in adapter_args.split(",") if a.strip()]
    except DroidMeshError as e:
        raise click.UsageError(str(e)) from None
    if not refs:
        raise click.BadParameter("give at least one adapter", param_hint="'--adapters'")
    result = suite.measure(base.path, [(r.name, r.path) for r in refs], counts, tokens, repeats, device, dtype, threads,
                           log=lambda m: click.echo(m, err=True))
    click.echo(report.format_table(result["rows"], ["layout", "adapters", "served_models", "rss_mib",
                                                    "ratio_to_one_merged", "host_mib", "anon_mib", "file_mib",
                                                    "rss_loaded_mib", "hwm_mib", "estimate"]))
    click.echo(report.format_table(result["receivers"], ["layout", "adapters", "served_models", "rss_mib",
                                                         "ratio_to_one_merged"]))
    pre = result["prefill"]
    click.echo(f"prefill of {pre['tokens']} tokens (median of {repeats}), wall: " + ", ".join(
        f"{k} {v:.3f} s" for k, v in pre["seconds"].items()) + "; CPU: " + ", ".join(
        f"{k} {v:.3f} s" for k, v in pre["cpu_seconds"].items()))
    click.echo(f"view / merged: wall {pre['view_over_merged']:.3f}, CPU {pre['cpu_view_over_merged']:.3f} (the LoRA adds "
               f"{pre['lora_macs_share']:.2%} multiply-adds)")
    if result["note"]:
        click.echo(result["note"])
    save(json_path, "adapters", {"base_label": base.label, "adapter_labels": [r.label for r in refs], "counts": counts,
                                 "threads": threads, "device": device, "dtype": dtype, **result})
    if plot_path:
        suite.plot(result, plot_path)


COMMANDS = (adapters,)
