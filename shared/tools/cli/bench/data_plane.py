"""`droidmesh bench` suites of the data plane: pipelining, link bandwidth, same-host transfer, a
stalled sender, the control plane (registered on the `bench` group by `shared/tools/cli/bench/__init__.py`)."""

from __future__ import annotations

import click

from droidmesh.shared import report
from droidmesh.shared.tools.cli.bench.kit import GROUP_HELP, demo_pair, launched_device_option, model_pair, save
from droidmesh.shared.tools.cli.params import GROUP, SHAPE_NAMES, device_name, float_list, int_list, raw_codec_list


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--tokens", default=4096, show_default=True, type=click.IntRange(16, 32768))
@click.option("--group", default="0:6", type=GROUP, show_default=True, help=GROUP_HELP)
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--transport", default="ucx", show_default=True, type=click.Choice(["ucx", "nixl", "shm"]),
              help="Bulk channel between the sender and the probe (both on this host).")
@click.option("--pair", "pair_spec", default=None,
              help="SENDER:RECEIVER as `zoo list` names models (e.g. real/base:real/docqa) or checkpoint paths "
                   "(default: the zoo's first demo pair).")
@launched_device_option
def pipeline(json_path, tokens, group, repeats, transport, pair_spec, device) -> None:
    """Pipelining: load-all vs load-reused vs pipelined, over a bulk channel between processes."""
    from droidmesh.shared.tools.bench.pipelining import run_pipeline

    sender, receiver = model_pair(pair_spec, group)
    r = run_pipeline(sender, receiver, tokens, group, repeats, device, transport)
    rows = [{"mode": m, "seconds": s, "vs_piped": s / r["seconds"]["piped"]} for m, s in r["seconds"].items()]
    click.echo(report.format_table(rows, ["mode", "seconds", "vs_piped"]))
    click.echo(f"pipeline_overhead = TTFT(piped) / max(recompute, transfer) = {r['pipeline_overhead']:.3f}")
    save(json_path, "pipeline", r)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False))
@click.option("--tokens", default=4096, show_default=True, type=click.IntRange(16, 32768))
@click.option("--group", default="0:6", type=GROUP, show_default=True, help=GROUP_HELP)
@click.option("--rates", default="500,1000,2000,5000,0", show_default=True, callback=float_list(),
              help="Mbit/s; 0 = unlimited.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Rounds per rate (median; odd, as the median of two is their mean and one stalled pull halves it).")
@click.option("--transport", default="ucx", show_default=True, type=click.Choice(["ucx", "nixl"]),
              help="Bulk channel of the sender and the probe (DM_SENDER_TRANSPORT / DM_RECEIVER_TRANSPORT).")
@click.option("--ucx-tls", default="tcp,self", show_default=True,
              help="UCX_TLS of both processes: two hosts share no memory, so shared memory and CMA (which "
                   "would bypass the veth in two namespaces of one kernel) are off; '' keeps the channel's "
                   "own. An UCX_TLS in the environment wins.")
@launched_device_option
def bandwidth(json_path, plot_path, tokens, group, rates, repeats, transport, ucx_tls, device) -> None:
    """Link rate: sender and receiver in their own namespaces over a tc-limited veth link."""
    from droidmesh.shared.tools.bench.bandwidth import run_bandwidth

    sender, receiver = demo_pair(group)
    rate_list = [r or None for r in rates]
    try:
        rows = run_bandwidth(sender, receiver, tokens, group, repeats, rate_list, device, transport, ucx_tls or None)
    except RuntimeError as e:
        click.echo(str(e), err=True)
        save(json_path, "bandwidth", {"skipped": str(e)})
        return
    table = [{"configured_gbit_s": r["configured_gbit_s"], "transport": r["transport"],
              "ucx_transports": r["ucx_transports"], "achieved_gbit_s": r["achieved_gbit_s"],
              "link_efficiency": r["link_efficiency"], **{k: r["seconds"][k] for k in ("piped", "reused", "all", "prefill")}}
             for r in rows]
    click.echo(report.format_table(table, list(table[0])))
    effs = [r["link_efficiency"] for r in rows if r["link_efficiency"]]
    save(json_path, "bandwidth", {"rows": rows, "link_efficiency": min(effs) if effs else None,
                                   "transport": transport, "ucx_tls": rows[0]["ucx_tls"] if rows else None,
                                   "tokens": tokens, "group": list(group)})
    if plot_path:
        _plot_bandwidth(table, plot_path)


def _plot_bandwidth(table: list[dict], path: str) -> None:
    plt = report.pyplot()

    xs = [r["configured_gbit_s"] or max(r["achieved_gbit_s"] for r in table) * 1.5 for r in table]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("piped", "pipelined"), ("reused", "load reused, then compute"), ("all", "load all, then compute"),
                       ("prefill", "full prefill")):
        ax.plot(xs, [r[key] for r in table], "o-", label=label)
        report.label_points(ax, xs, [r[key] for r in table])
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Gbit/s; rightmost = unlimited)")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _transport_list(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> list[str] | None:
    out = [t.strip() for v in value for t in v.split(",") if t.strip()]
    return list(dict.fromkeys(out)) or None


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--sizes", default="262144,1048576,4194304,16777216,67108864,268435456", show_default=True,
              callback=int_list, help="Bytes per tensor.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--transport", "transports", multiple=True, callback=_transport_list,
              help="Bulk channel(s) to measure; repeat or give a comma list (default: every channel between "
                   "processes, e.g. ucx,nixl,shm; one that cannot start is reported as unavailable).")
@click.option("--shm-lanes", default=2, show_default=True, type=click.IntRange(1, 16),
              help="Copy threads of the shm channel's client (the receiver uses 2).")
@click.option("--items", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="Items per pull, each of the size given (a context's layers travel as many items in one pull).")
@click.option("--no-grants", is_flag=True, help="Pull without grants (no nats-server; the channel's own cost only).")
def transfer(json_path, sizes, repeats, transports, shm_lanes, items, no_grants) -> None:
    """Data plane: pulls over each bulk channel between two processes vs a memcpy of the same bytes
    (warm and out of cache, one thread); ratio = throughput / warm memcpy. Each pull moves ITEMS
    items of each size; a pull's fixed cost (one 4 KiB item, with and without its grant over a real
    nats-server) is measured per channel. `--transport nixl_raw` adds NIXL itself as a row."""
    from droidmesh.shared.tools.bench.bulk_transfer import RATIO_FROM_BYTES, run_transfer

    r = run_transfer(sizes, repeats, transports, shm_lanes, items, grants=not no_grants)
    columns = ["bytes", "items", "item_bytes", "transport", "throughput_gb_s", "memcpy_gb_s", "memcpy_cold_gb_s",
               "ratio", "ucx_transports"]
    if any("unavailable" in row for row in r["rows"]):
        columns.append("unavailable")
    click.echo(report.format_table(r["rows"], columns))
    for transport, ratio in r["over_memcpy"].items():
        if ratio is not None:
            click.echo(f"{transport}: smallest throughput / memcpy from {RATIO_FROM_BYTES >> 20} MiB pulled up = {ratio:.3f}")
    fixed = [{"transport": t, **c} for t, c in r["fixed_cost"].items() if c is not None]
    if fixed:
        click.echo("fixed cost of a pull (one 4 KiB item; medians, µs):")
        click.echo(report.format_table(fixed, ["transport", "grant_us", "pull_us", "with_grant_us", "samples"]))
    for size, ratio in r["nixl_over_raw"].items():
        click.echo(f"nixl / nixl_raw at {int(size) >> 10} KiB x {items}: {ratio:.3f}")
    save(json_path, "transfer", r)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--group", default="4:6", type=GROUP, show_default=True, help=GROUP_HELP)
@click.option("--transport", default="ucx", show_default=True, type=click.Choice(["ucx", "nixl", "shm"]))
@click.option("--requests", "n", default=9, show_default=True, type=click.IntRange(3, 200),
              help="Requests over the healthy sender's context per phase.")
@click.option("--stalled", "k", default=2, show_default=True, type=click.IntRange(1, 32),
              help="Requests left waiting on the frozen sender.")
@click.option("--words", default=500, show_default=True, type=click.IntRange(10, 600),
              help="Words per context (500: ~2.9K tokens on the demo tier).")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Services' logs (default: a temporary directory).")
def stall(json_path, group, transport, n, k, words, log_dir) -> None:
    """A frozen sender vs the requests that do not use it: their TTFT before and while it stalls."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.tools.bench import stall as suite

    sender, receiver = demo_pair(group)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-stall-"))
    r = suite.run_stall(sender, receiver, group, logs, transport=transport, n=n, k=k, words=words)
    click.echo(report.format_table(r["rows"], suite.COLUMNS))
    click.echo(f"stall_ratio = TTFT p50 while a sender stalls / before = {r['stall_ratio']:.3f} "
               f"({r['still_waiting_after_series']} of {k} stalled requests still waiting at the end)")
    save(json_path, "stall", r)


@click.command("sender-loop")
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--transport", default="ucx", show_default=True, type=click.Choice(["ucx", "nixl"]))
@click.option("--shape", default="smollm2-135m", show_default=True, type=click.Choice(SHAPE_NAMES),
              help="A named model shape (its K / V widths).")
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(16, 32768))
@click.option("--codecs", "codec_list", default="raw,int8,int4", show_default=True, callback=raw_codec_list,
              help="Comma list of codecs to pull with (raw, int8, int4: those that need no maps or layers).")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--device", default="cpu", show_default=True, callback=device_name,
              help="Where the sender holds the context: cpu, cuda or cuda:N.")
@click.option("--client-process", is_flag=True,
              help="Pull from a process of its own, as a receiver does (default: a thread of this one, sharing its GIL).")
def sender_loop(json_path, transport, shape, tokens, codec_list, repeats, device, client_process) -> None:
    """A sender's event loop while it answers pulls: the longest it could not run (its lag) during
    a pull of every layer's K / V, per codec, for a newly captured context."""
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.tools.bench import sender_loop as suite

    try:
        r = suite.measure(transport, shape, tokens, codec_list, repeats, device,
                          progress=lambda s: click.echo(f"  {s}", err=True), client_process=client_process)
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None
    click.echo(suite.title(r))
    click.echo(report.format_table(r["rows"], suite.COLUMNS))
    save(json_path, "sender_loop", r)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--events", default=1000, show_default=True, type=click.IntRange(10, 100000))
def control(json_path, events) -> None:
    """Control plane: availability event -> visible in the broker index; lookup round trip."""
    from droidmesh.shared.tools.bench.control_plane import run_control

    r = run_control(events)
    click.echo(report.format_table([r], list(r)))
    save(json_path, "control", r)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--transport", default="ucx", show_default=True, type=click.Choice(["ucx", "nixl", "shm"]))
@click.option("--seconds", "idle_s", default=60.0, show_default=True, type=click.FloatRange(1, 3600),
              help="How long the warmed mesh idles while its CPU is counted.")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Services' logs (default: a temporary directory).")
def idle(json_path, transport, idle_s, log_dir) -> None:
    """Idle services: every service started, one reused request (the bulk connection open), then
    CPU seconds per process over an idle window."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.tools.bench import idle as suite
    from droidmesh.shared.tools.cli.bench.kit import DEFAULT_GROUPS

    group = DEFAULT_GROUPS["base"]
    sender, receiver = demo_pair(group)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-idle-"))
    r = suite.run_idle(sender, receiver, group, logs, transport=transport, idle_s=idle_s)
    click.echo(report.format_table(r["rows"], suite.COLUMNS))
    click.echo(f"{transport}: {sum(row['meets_target'] for row in r['rows'])} of {len(r['rows'])} processes at most "
               f"{suite.TARGET:.0%} of a core over {r['idle_s']:.0f} s idle")
    save(json_path, "idle", r)


COMMANDS = (pipeline, bandwidth, transfer, stall, sender_loop, control, idle)
