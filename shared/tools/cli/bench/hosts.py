"""`droidmesh bench hosts`: pulls between hosts, modelled (`shared/tools/bench/hosts.py`): a plan's
bytes against the link, per path (GPUDirect RDMA, pinned staging, today's channels), and where
relaying pays against a GPU's measured engine."""

from __future__ import annotations

import dataclasses

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.params import SHAPE_NAMES, float_list, int_list, raw_codec_list


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="TTFT through the mesh against the link (needs --engine).")
@click.option("--shape", default="llama3-8b", show_default=True, type=click.Choice(SHAPE_NAMES))
@click.option("--engine", "engine_path", type=click.Path(exists=True, dir_okay=False),
              help="A GPU check's JSON (infra/gpu/check.sh) for this shape: the engine's own TTFT per context and plan.")
@click.option("--contexts", default="4096,16384,32768", show_default=True, callback=int_list)
@click.option("--links", "gbit_s", default="25,100,200,400", show_default=True, callback=float_list(open_min=True),
              help="Link rates, Gbit/s.")
@click.option("--codecs", "codec_names", default="raw,int8,int4", show_default=True, callback=raw_codec_list)
@click.option("--pcie-gbs", default=50.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Pinned host <-> device copy, GB/s (one H200 host measured 50-54).")
@click.option("--export-gbs", default=2.5, show_default=True, type=click.FloatRange(min=0.1),
              help="Today's path: a device context's plan copied into a per-pull host memfd, GB/s (the nixl "
                   "channel moved device memory at 2.1-2.9 GB/s end to end on one H200; the transfer check's "
                   "nixl rows measure it).")
@click.option("--fixed-ms", default=1.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Before a pull's first byte: the grant over NATS and the pull's request.")
@click.option("--efficiency", default=1.0, show_default=True, type=click.FloatRange(min=0.01, max=1.0),
              help="Share of the link's rate a pull gets (1: the link's own rate, a lower bound on time).")
def hosts(json_path, plot_path, shape, engine_path, contexts, gbit_s, codec_names, pcie_gbs, export_gbs, fixed_ms,
          efficiency) -> None:
    """Between hosts, modelled: a plan's bytes on the wire per path and link, and with --engine the
    TTFT through the mesh (as the receiver's policy predicts it) against the engine alone and the
    full prefill, and the least link rate at which relaying pays."""
    from droidmesh.shared.tools.bench import hosts as model

    rates = model.Rates(pcie_gbs, export_gbs, fixed_ms, efficiency)
    if plot_path and (engine_path is None or "raw" not in codec_names):
        raise click.UsageError("--plot draws the raw k = 2 plan against a GPU check's times: it needs --engine and raw "
                               "in --codecs")
    try:
        engine = model.engine_rows(engine_path) if engine_path else None
        rows = model.rows(shape, contexts, codec_names, gbit_s, rates, engine)
        even = model.break_even(shape, contexts, codec_names, rates, engine)
    except (DroidMeshError, KeyError, ValueError, TypeError) as e:
        raise click.ClickException(f"{engine_path or shape}: {e}") from None
    if engine is not None and not any(r["engine_s"] is not None for r in rows):
        raise click.ClickException(f"{engine_path} has no row for contexts {contexts} of {shape}")
    columns = ["context", "plan", "codec", "path", "link_gbit_s", "wire_mb", "pull_s"]
    if engine is not None:
        columns += ["engine_s", "mesh_s", "full_prefill_s", "mesh_over_engine", "relay_pays"]
    click.echo(report.format_table(rows, columns))
    click.echo("least link rate (Gbit/s) at which:" if engine else "a pull's time at 100 Gbit/s (what a prefill must exceed):")
    keys = {k for r in even for k in r}
    shown = [{k: "never" if v is None and k.endswith("_from_gbit_s") else v for k, v in r.items()} for r in even]
    click.echo(report.format_table(shown, [c for c in ("context", "plan", "codec", "path", "wire_mb", "pays_from_gbit_s",
                                                       "target_from_gbit_s", "pull_at_100g_s") if c in keys]))
    save(json_path, "hosts", {"shape": shape, "engine": engine_path, "rates": dataclasses.asdict(rates),
                              "targets_mesh_over_engine": model.TARGETS, "rows": rows, "break_even": even})
    if plot_path:
        _plot(rows, plot_path)


def _plot(rows: list[dict], path: str) -> None:
    """Per context, the raw k = 2 plan's TTFT through the mesh against the link, per path, beside
    the engine alone and the full prefill."""
    plt = report.pyplot()
    contexts = sorted({r["context"] for r in rows if r["mesh_s"] is not None and r["full_prefill_s"] is not None
                       and r["codec"] == "raw" and r["plan"] == "k = 2 with E"})
    cols = min(2, len(contexts))
    fig, axes = plt.subplots(-(-len(contexts) // cols), cols, figsize=(4.6 * cols, 3.4 * -(-len(contexts) // cols)),
                             squeeze=False)
    for ax in axes.flat[len(contexts):]:
        ax.set_visible(False)
    for ax, tokens in zip(axes.flat, contexts, strict=False):
        mine = [r for r in rows if r["context"] == tokens and r["plan"] == "k = 2 with E" and r["codec"] == "raw"]
        for way in dict.fromkeys(r["path"] for r in mine):
            line = [r for r in mine if r["path"] == way]
            xs, ys = [r["link_gbit_s"] for r in line], [r["mesh_s"] * 1e3 for r in line]
            ax.plot(xs, ys, "o-", label=way)
            if way in ("gpudirect", "today"):  # the others lie on or between these two
                report.label_points(ax, xs, ys, "{:.0f}")
        alone, prefill = mine[0]["engine_s"] * 1e3, mine[0]["full_prefill_s"] * 1e3
        ax.axhline(alone, color="k", ls=":", label=f"engine alone ({alone:.0f} ms)")
        ax.axhline(prefill, color="r", ls="--", label=f"full prefill ({prefill:.0f} ms)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        links = sorted({r["link_gbit_s"] for r in mine})
        ax.set_xticks(links, [f"{g:g}" for g in links])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_title(f"{tokens // 1024}K tokens, k = 2 with E, raw", fontsize=9)
        ax.set_xlabel("link (Gbit/s)")
        ax.set_ylabel("TTFT through the mesh (ms)")
    for ax in axes.flat[:len(contexts)]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


COMMANDS = (hosts,)
