"""`droidmesh bench ...`: benchmark suites (tables on stdout, JSON and plots on request)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli import bench_data_plane, bench_peer
from droidmesh.shared.tools.cli.bench_kit import GROUP_HELP, demo_pair, launched_device_option, save
from droidmesh.shared.tools.cli.model_options import device_options
from droidmesh.shared.tools.cli.params import GROUP, check_group, checkpoint_layers, float_list, int_list

if TYPE_CHECKING:
    from droidmesh.shared.tools.bench.load import ConcurrencyMode

# Before the zoo's demo tier exists, latency runs on a random-init 12-layer model of this shape.
SHAPE_NAMES = ("llama3-8b", "qwen2.5-7b", "llama3.2-1b", "tiny")  # shared/model/shapes.py (imported lazily: transformers)
RANDOM_BENCH_MODEL: dict[str, Any] = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=6,
    num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192,
)


@click.group()
def bench() -> None:
    """Benchmark suites: each prints a table and writes --json (and --plot where it plots)."""


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows and machine info here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a speedup-vs-k PNG here.")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False),
              help="Local HF checkpoint (default: a random-init 12-layer Llama).")
@click.option("--shape", type=click.Choice(sorted(SHAPE_NAMES)), default=None,
              help="A named architecture, random-init directly on the device (latency and memory only).")
@click.option("--contexts", default="1024,2048,4096", callback=int_list, show_default=True,
              help="Context lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@device_options
@click.option("--threads", default=None, type=click.IntRange(1, 256), help="torch threads (default: torch's).")
def ttft(json_path, plot_path, model_path, shape, contexts, repeats, device, dtype,
         threads) -> None:
    """Receiver TTFT: full prefill vs full reuse vs partial prefill with k layers recomputed."""
    from droidmesh.shared.model import shapes
    from droidmesh.shared.model.adapter import load_model, random_model
    from droidmesh.shared.tools.bench import ttft as suite

    if threads:
        import torch

        torch.set_num_threads(threads)
    if model_path and shape:
        raise click.UsageError("give --model or --shape, not both")
    try:
        if model_path:
            model = load_model(model_path, device=device, dtype=dtype)
        elif shape:
            model = shapes.build(shape, device, dtype)
        else:
            click.echo("no --model given: using a random-init 12-layer Llama (latency only, no quality)", err=True)
            model = random_model("llama", device=device, dtype=dtype, name="random-llama-12L", **RANDOM_BENCH_MODEL)
    except DroidMeshError as e:  # no such GPU, not a checkpoint: one line
        raise click.UsageError(str(e)) from None
    rows = suite.measure(model, contexts, repeats)
    cols = ["context_tokens", "mode", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal_speedup"]
    click.echo(report.format_table(rows, cols))
    report.write_json(json_path, {"suite": "ttft", "machine": report.machine(), "model": report.model_record(model),
                                  "rows": rows})
    if plot_path:
        suite.plot(rows, plot_path)


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False))
@click.option("--tokens", default=None, type=click.IntRange(16, 32768),
              help="Context tokens (default 2048; concurrency: 1024).")
@click.option("--group", default="0:2", type=GROUP, show_default=True, help=GROUP_HELP)
@click.option("--rates", default="0.5,1,2,4", show_default=True, callback=float_list(0, open_min=True),
              help="Requests per second.")
@click.option("--seconds", default=20.0, show_default=True, type=click.FloatRange(1, 3600))
@click.option("--slo", default=1.0, show_default=True, type=click.FloatRange(0.001, 600), help="TTFT SLO (s).")
@click.option("--copies", default="1,2", show_default=True, callback=int_list, help="Receiver copies to try.")
@click.option("--workload", default="requests", show_default=True,
              type=click.Choice(["requests", "agents", "concurrency"]),
              help="requests: one prompt per arrival, auto vs full prefill; agents: `droidmesh agents` rows "
                   "arriving at each rate (rows per second), several in flight; concurrency: a closed loop of "
                   "full-prefill requests at each --concurrency, per receiver --batch.")
@click.option("--rows", "n_rows", default=20, show_default=True, type=click.IntRange(1, 500),
              help="agents: rows per rate.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False),
              help="agents: the services' logs go here, for `droidmesh audit --logs` (default: a temporary directory).")
@click.option("--relay-policy", "policy_path", type=click.Path(exists=True, dir_okay=False),
              help="agents: a relay audit's policy file (`droidmesh audit --policy`) the pair configs carry.")
@click.option("--concurrency", "concurrencies", default="1,2,4,8,16", show_default=True, callback=int_list,
              help="concurrency: clients in flight at once, one level each.")
@click.option("--batch", "batches", default="1,16", show_default=True, callback=int_list,
              help="concurrency: receiver max_batch values to compare (1: one request's decode at a time).")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(1, 1024),
              help="concurrency: max_new_tokens of every request (an answer that ends sooner counts what it made).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 100),
              help="concurrency: requests each client sends back to back, per level.")
@click.option("--pair", "pair_spec", default=None,
              help="concurrency: SENDER:RECEIVER as `zoo list` names models or checkpoint paths; only the receiver "
                   "runs (default: the zoo's first demo pair). The real measurement: real/base:real/base, which "
                   "decodes the whole --new-tokens; real/docqa (the same size) ends its answers after a few.")
@click.option("--serve", "serve_mode", default="full_prefill", show_default=True,
              type=click.Choice(["full_prefill", "reuse"]),
              help="concurrency: full_prefill: the receiver computes every prompt; reuse: the pair's sender holds "
                   "every context first and requests go in auto mode (how DroidMesh serves: prefill is a reuse).")
@click.option("--dtype", "load_dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="concurrency: the services' weights and cache dtype.")
@click.option("--pool-tokens", default=0, show_default=True, type=click.IntRange(0, 1 << 20),
              help="concurrency: the batched receivers decode in a decode pool of this many tokens per slot "
                   "(receiver decode_pool_tokens; 0: each request's own cache).")
@launched_device_option
def load(json_path, plot_path, tokens, group, rates, seconds, slo, copies, workload, n_rows, log_dir, policy_path,
         concurrencies, batches, new_tokens, rounds, pair_spec, serve_mode, load_dtype, pool_tokens, device) -> None:
    """Poisson arrivals against 1 and 2 receivers: TTFT/TBT/E2E p50/p99 and goodput vs full prefill
    (`--workload agents`: the agents pipeline at each rate, its audit's randomized arms;
    `--workload concurrency`: decode tokens/s and TTFT per concurrency, batched vs one at a time)."""
    from droidmesh.shared.tools.bench.load import run_load

    if workload == "agents":
        _load_agents(json_path, rates, n_rows, log_dir, policy_path)
        return
    if workload == "concurrency":
        _load_concurrency(json_path, plot_path, tokens or 1024, concurrencies, batches, new_tokens, rounds,
                          pair_spec, device, serve_mode, load_dtype, group, pool_tokens)
        return
    tokens = tokens or 2048
    sender, receiver = demo_pair(group)
    rows = run_load(sender, receiver, group, tokens, rates, seconds, slo, copies, device)
    cols = ["receivers", "rate", "mode", "requests", "ttft_p50", "ttft_p99", "tbt_p50", "e2e_p50", "e2e_p99", "goodput"]
    click.echo(report.format_table(rows, cols))
    best = {m: max((r["goodput"] for r in rows if r["mode"] == m), default=0.0) for m in ("auto", "full_prefill")}
    ratio = best["auto"] / best["full_prefill"] if best["full_prefill"] else None
    click.echo(f"goodput_ratio (best DroidMesh / best full prefill at TTFT <= {slo}s) = {ratio}")
    save(json_path, "load", {"rows": rows, "slo_s": slo, "goodput_ratio": ratio, "tokens": tokens, "group": list(group)})
    if plot_path:
        _plot_load(rows, plot_path, slo)


def _load_agents(json_path: str | None, rates: list[float], n_rows: int, log_dir: str | None,
                 policy_path: str | None) -> None:
    """`bench load --workload agents`: per rate and agent, TTFT p50 / p99 and the path mix; the logs
    carry each request's queue depth (the audit's load strata) and its randomized arm."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.audit.relay import read_relay_policy
    from droidmesh.shared.tools.apps.agents import demo_tier, run_agents, table
    from droidmesh.shared.zoo.tiers import get_recipe

    models, profiles = demo_tier()
    relay = read_relay_policy(policy_path) if policy_path else []
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-load-agents-"))
    click.echo(f"agents load: {n_rows} rows at each of {rates} rows/s; logs in {logs}", err=True)
    summary, _ = run_agents(models, profiles, n_rows, get_recipe("demo").suite, logs, lambda m: click.echo(m, err=True),
                            holdout_share=0.3, shadow_share=0.3, relay=relay, blind_share=0.2, rates=rates)
    click.echo(table(summary))
    click.echo(f"audit it: droidmesh audit --logs {logs}")
    save(json_path, "load_agents", {"rows": summary, "rates": rates, "rows_per_rate": n_rows, "logs": str(logs)})


SYNTHETIC_TIERS = ("demo", "ci", "family")  # word-level zoo tokenizers: filler contexts; any other model: real text


def _load_concurrency(json_path: str | None, plot_path: str | None, tokens: int, concurrencies: list[int],
                      batches: list[int], new_tokens: int, rounds: int, pair_spec: str | None, device: str,
                      mode: ConcurrencyMode, dtype: str, group: tuple[int, int], pool_tokens: int) -> None:
    """`bench load --workload concurrency` (`shared/tools/bench/load.py`'s `run_concurrency`)."""
    from pathlib import Path

    from droidmesh.shared.tools.bench.load import TextSource, run_concurrency
    from droidmesh.shared.tools.cli.bench_kit import model_pair
    from droidmesh.shared.zoo.manifest import tier_dirs

    sender, receiver = model_pair(pair_spec, group)
    where = Path(receiver).resolve()
    synthetic = any(where.is_relative_to(d.resolve()) for t in SYNTHETIC_TIERS for d in tier_dirs(t))
    source: TextSource = "filler" if synthetic else "real"
    batches, concurrencies = sorted(set(batches)), sorted(set(concurrencies))
    click.echo(f"concurrency load: receiver {receiver}, {source} contexts of ~{tokens} tokens, {new_tokens} new "
               f"tokens, {rounds} rounds per client, max_batch {batches}"
               + (f", batched in a decode pool of {pool_tokens} tokens per slot" if pool_tokens else ""), err=True)
    r = run_concurrency(receiver, tokens, concurrencies, batches, rounds, new_tokens, source, device, mode=mode,
                        sender_path=sender, dtype=dtype, group=group, pool_tokens=pool_tokens)
    cols = ["max_batch", "concurrency", "requests", "errors", "tokens_mean", "decode_tokens_per_s", "tokens_per_s",
            "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "tbt_p50", "paths"]
    click.echo(report.format_table(r["rows"], cols))
    click.echo(report.format_table(r["compare"], ["concurrency", "max_batch", "baseline_batch", "speedup_decode",
                                                  "ttft_ratio"]))
    click.echo(f"load average (1, 5, 15 min): {r['loadavg_start']} at start, {r['loadavg_end']} at end")
    save(json_path, "load_concurrency", {**r, "sender": sender if mode == "reuse" else None, "receiver": receiver,
                                         "contexts": source, "tokens": tokens, "new_tokens": new_tokens,
                                         "rounds": rounds})
    if plot_path:
        _plot_concurrency(r["rows"], plot_path)


def _plot_concurrency(rows: list[dict], path: str) -> None:
    plt = report.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mb in sorted({r["max_batch"] for r in rows}):
        rs = sorted((r for r in rows if r["max_batch"] == mb), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        label = "one at a time" if mb == 1 else f"batched (max_batch {mb})"
        for ax, key in ((a, "decode_tokens_per_s"), (b, "ttft_p50")):
            ys = [r[key] for r in rs]
            ax.plot(xs, ys, "o-" if mb > 1 else "s--", label=label)
            report.label_points(ax, xs, ys)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, ylabel in ((a, "decode tokens/s (aggregate)"), (b, "TTFT p50 (s)")):
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_load(rows: list[dict], path: str, slo: float) -> None:
    plt = report.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n in sorted({r["receivers"] for r in rows}):
        for mode, style in (("auto", "o-"), ("full_prefill", "s--")):
            rs = [r for r in rows if r["receivers"] == n and r["mode"] == mode]
            label = f"{'DroidMesh' if mode == 'auto' else 'full prefill'} x{n}"
            a.plot([r["rate"] for r in rs], [r["ttft_p99"] for r in rs], style, label=label)
            b.plot([r["rate"] for r in rs], [r["goodput"] for r in rs], style, label=label)
            report.label_points(a, [r["rate"] for r in rs], [r["ttft_p99"] for r in rs])
            report.label_points(b, [r["rate"] for r in rs], [r["goodput"] for r in rs])
    a.axhline(slo, c="k", ls=":", label="SLO")
    a.set_xlabel("arrival rate (req/s)")
    a.set_ylabel("TTFT p99 (s)")
    a.set_yscale("log")
    b.set_xlabel("arrival rate (req/s)")
    b.set_ylabel("goodput (req/s within SLO)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False))
@click.option("--pair", "pair_index", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Which of the zoo's pairs.")
@click.option("--rows", default=32, show_default=True, type=click.IntRange(1, 1000))
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False),
              help="A `droidmesh profile` JSON whose frontier to sweep (default: the zoo's, if saved).")
@click.option("--long-tokens", default=4096, show_default=True, type=click.IntRange(16, 65536),
              help="Tokens of the long context each config's second TTFT (`ttft_4k_s`) is timed on.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Timed runs per TTFT (median), after one untimed.")
@device_options
def quality(json_path, plot_path, pair_index, rows, profile_path, long_tokens, repeats, device, dtype) -> None:
    """TTFT vs quality for full prefill, full reuse, CacheBlend and DroidMesh groups."""
    import json
    from pathlib import Path

    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.profiling.profile import load_rows
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench import quality as suite
    from droidmesh.shared.zoo.manifest import find_tiers, profile_file, resolve_model
    from droidmesh.shared.zoo.tiers import get_recipe

    tiers = find_tiers()
    if not tiers:
        raise click.ClickException("no zoo tier built: run `droidmesh zoo build --tier demo` (or ci)")
    tier, root, man = tiers[0]
    if pair_index >= len(man["pairs"]):
        raise click.BadParameter(f"the {tier} tier has {len(man['pairs'])} pairs (0..{len(man['pairs']) - 1}), "
                                 f"not {pair_index}", param_hint="'--pair'")
    pair = man["pairs"][pair_index]
    names = Pair(pair["sender"], pair["receiver"])
    try:
        s_ref, r_ref = resolve_model(f"{tier}/{names.sender}"), resolve_model(f"{tier}/{names.receiver}")
        sender = load_model(s_ref.path, device=device, dtype=dtype, name=s_ref.name)
        receiver = load_model(r_ref.path, device=device, dtype=dtype, name=r_ref.name)
    except DroidMeshError as e:  # no such GPU: one line
        raise click.UsageError(str(e)) from None
    shape = get_recipe(tier).suite
    ev = PairScorer(sender, receiver, load_rows(pair["task"], "test", rows, shape=shape), task_spec(pair["task"]))
    prof = Path(profile_path) if profile_path else profile_file(root, names)
    frontier = json.loads(prof.read_text())["frontier"] if prof.is_file() else None
    result = suite.measure(sender, receiver, ev, frontier, long_tokens=long_tokens, repeats=repeats)
    click.echo(report.format_table(result["rows"], ["config", "recomputed_layers", "quality", "ttft_s", "speedup",
                                                    "ttft_4k_s", "speedup_4k"]))
    click.echo(f"sender alone: {result['sender_alone']:.3f}; speedup_at_5pct (4K tokens): {result['speedup_at_5pct']}")
    save(json_path, "quality", {"pair": pair, "tier": tier, "model": report.model_record(receiver), **result})
    if plot_path:
        suite.plot(result, plot_path, f"{names.id} ({pair['task']})")


DEFAULT_GROUPS = {"base": (4, 6), "summ": (0, 6)}  # the demo pairs' profiled groups, when no profile is saved
DEFAULT_GROUP = (6, 12)  # any other pair's, when no profile is saved and no --group is given


def _split_pair(spec: str) -> tuple[str, str]:
    """`SENDER:RECEIVER` -> (sender, receiver); a bare name takes the other side's tier, if that
    one is tier-qualified (`real/base:docqa` is `real/base:real/docqa`)."""
    from droidmesh.shared.zoo.manifest import TIER_ORDER

    s, sep, r = spec.partition(":")
    s, r = s.strip(), r.strip()
    if not sep or not s or not r:
        raise click.BadParameter(f"{spec!r}: expected SENDER:RECEIVER", param_hint="'--pairs'")
    tiers = [t for t, sep_, _ in (x.partition("/") for x in (s, r)) if sep_ and t in TIER_ORDER]
    if len(tiers) == 1:
        s, r = (x if "/" in x else f"{tiers[0]}/{x}" for x in (s, r))
    return s, r


def _pair_group(tier: str | None, sender: str, receiver: str) -> tuple[tuple[int, int], str]:
    """The pair's group and where it comes from: the saved profile's chosen group (in any of the
    tier's directories, e.g. zoo/real/profiles/base-to-docqa.json) where it is a group (not full
    reuse) that holds on its test split, else the demo pairs' known group, else `DEFAULT_GROUP`."""
    import json

    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.zoo.manifest import profile_file, tier_dirs

    why_not = "no profile saved"
    for d in tier_dirs(tier) if tier else []:
        prof = profile_file(d, Pair(sender, receiver))
        chosen = json.loads(prof.read_text()).get("chosen") if prof.is_file() else None
        if not chosen:
            continue
        if chosen.get("passes_test") is False:
            why_not = f"profile {prof} chose a plan that fails its test split"
        elif int(chosen["end"]) <= int(chosen["start"]):
            why_not = f"profile {prof} chose full reuse"
        else:
            return (int(chosen["start"]), int(chosen["end"])), f"profile {prof}"
    if tier == "demo" and sender in DEFAULT_GROUPS:
        return DEFAULT_GROUPS[sender], f"the demo pair's profiled group ({why_not})"
    return DEFAULT_GROUP, f"default ({why_not}; --group sets it)"


def _codec_pairs(value: str, group: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """`--pairs base:qa,real/base:real/docqa` -> [{"name", "sender", "receiver", "group", ...}]:
    zoo model names as `zoo list` prints them (a bare name: the demo tier's, else the first
    tier's, or the other side's tier) or checkpoint paths; the group: `group` (--group), else
    `_pair_group`'s. `name` is `SENDER->RECEIVER` by model id."""
    from droidmesh.shared.zoo.manifest import find_tiers, resolve_model

    tiers = find_tiers()
    specs = [_split_pair(v) for v in value.split(",") if v.strip()]
    if not specs:
        raise click.BadParameter("no pair given", param_hint="'--pairs'")
    default_tier = next((t for t, _, _ in tiers if t == "demo"), tiers[0][0] if tiers else None)
    out: list[dict[str, Any]] = []
    for s, r in specs:
        try:
            s_ref, r_ref = (resolve_model(x if "/" in x or default_tier is None else f"{default_tier}/{x}") for x in (s, r))
            g, source = (group, "--group") if group else _pair_group(s_ref.tier or r_ref.tier, s_ref.name, r_ref.name)
            check_group(g, checkpoint_layers(r_ref.path), "--group" if group else f"{s}:{r}'s group ({source})")
        except DroidMeshError as e:
            raise click.BadParameter(str(e), param_hint="'--pairs'") from None
        name = f"{s_ref.name}->{r_ref.name}"
        if any(p["name"] == name for p in out):
            raise click.BadParameter(f"two pairs named {name}", param_hint="'--pairs'")
        out.append({"name": name, "sender": str(s_ref.path), "receiver": str(r_ref.path), "group": tuple(g),
                    "group_source": source, "sender_label": s_ref.label, "receiver_label": r_ref.label})
    return out


def _codec_choices(_ctx: click.Context | None, param: click.Parameter | None, value: str) -> list[str]:
    """click callback: `--codecs raw,int8,int4,scd` (`codec_tradeoff.CODEC_CHOICES`; `all`: every one)."""
    from droidmesh.shared.tools.bench.codec_tradeoff import CODEC_CHOICES

    got = [v.strip() for v in value.split(",") if v.strip()]
    if got == ["all"]:
        return list(CODEC_CHOICES)
    bad = [v for v in got if v not in CODEC_CHOICES]
    if bad or not got:
        raise click.BadParameter(f"{value!r}: expected a comma list of {', '.join(CODEC_CHOICES)} (or all)", param=param)
    return list(dict.fromkeys(got))


def _shares(_ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> list[float] | None:
    """click callback: lowrank shares, each in (0, 1]; None: the transfer search's."""
    if value is None:
        return None
    out = float_list(0, open_min=True)(_ctx, param, value)
    if max(out) > 1:
        raise click.BadParameter(f"shares are fractions of the fitted variance, in (0, 1]; got {value!r}", param=param)
    return out


CODECS_COLUMNS = ["pair", "tokens", "link_gbit", "config", "wire_bytes", "bytes_vs_raw", "bytes_vs_raw_group", "bytes_on_wire", "quality",
                  "quality_vs_full", "nll", "kl", "prepare_s", "encode_s", "decode_s", "ttft_s", "error"]
NO_MESH_COLUMNS = [c for c in CODECS_COLUMNS if c not in ("link_gbit", "bytes_on_wire", "ttft_s", "error")]


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every row and the targets here.")
@click.option("--plot-dir", type=click.Path(file_okay=False), help="Write quality-vs-TTFT PNGs, one per link rate.")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), help="Also write the printed table here.")
@click.option("--pairs", default="base:qa,summ:qa", show_default=True,
              help="SENDER:RECEIVER, comma list: zoo names as `zoo list` prints them (real/base:real/docqa; a bare "
                   "name is the demo tier's, or the other side's tier) or checkpoint paths.")
@click.option("--group", type=GROUP, default=None,
              help="Recompute group START,END of every pair (default: the pair's saved profile's, e.g. "
                   "zoo/real/profiles/base-to-docqa.json; else the demo pairs' known one; else 6,12).")
@click.option("--task", default="multihop_qa", show_default=True, help="Task of the rows (doc_qa for real/base:real/docqa).")
@click.option("--codecs", "codec_names", default="all", show_default=True, callback=_codec_choices,
              help="Config families beside the baselines (full prefill, full reuse raw), comma list of raw, int8, int4, "
                   "scd (lowrank at each --shares), scd-patch (lowrank with patch layers).")
@click.option("--shares", default=None, callback=_shares,
              help="Lowrank K/V variance shares kept, comma list (default: the transfer search's 0.8,0.9,0.95,0.99).")
@click.option("--rates", default="0.1,0.25,0.5,1,2", show_default=True, callback=float_list(0, open_min=True),
              help="Link rates, Gbit/s.")
@click.option("--tokens", default="1024,4096", show_default=True, callback=int_list,
              help="Context lengths (TTFT, codec timings, wire bytes).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Timed rounds per config (median; odd, as the median of two is their mean), after one dropped "
                   "warm-up round.")
@click.option("--rows", default=24, show_default=True, type=click.IntRange(1, 1000), help="Test rows scored per config.")
@click.option("--calibration-rows", default=16, show_default=True, type=click.IntRange(2, 1000),
              help="Train rows the SCD maps are fitted on.")
@click.option("--target-rate", default=0.25, show_default=True, type=float, help="Link rate of the targets (Gbit/s).")
@click.option("--no-mesh", is_flag=True,
              help="In process only: quality, wire bytes, encode/decode time; no TTFT (no network namespaces, no root).")
@click.option("--threads", default=None, type=click.IntRange(1, 256),
              help="torch threads of the in-process stage (default: torch's; launched processes use one).")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Maps files, configs (default: a temporary directory).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="The models' dtype, and so the wire's: bfloat16 as a sender serves; float32 scores as `droidmesh eval` "
                   "does on a CPU (reuse paths differ between the two by more than the rows' noise on the real tier).")
@launched_device_option
def codecs(json_path, plot_dir, table_path, pairs, group, task, codec_names, shares, rates, tokens, repeats, rows,
           calibration_rows, target_rate, no_mesh, threads, work_dir, dtype, device) -> None:
    """Codecs: quality, wire bytes, encode/decode time and TTFT over a rate-limited link per wire
    codec / SCD config (baselines included) of each pair; targets for the first pair."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.tools.bench import codec_tradeoff as suite
    from droidmesh.shared.tools.bench.codec_sweep import run_codecs

    pair_list = _codec_pairs(pairs, group)
    if threads:
        import torch

        torch.set_num_threads(threads)
    work = work_dir or tempfile.mkdtemp(prefix="dm-bench-codecs-")
    try:
        r = run_codecs(pair_list, tokens, rates, repeats, rows, work, task=task, calibration_rows=calibration_rows,
                       device=device, codecs=codec_names, shares=shares, over_mesh=not no_mesh, dtype=dtype)
    except RuntimeError as e:
        click.echo(str(e), err=True)
        save(json_path, "codecs", {"skipped": str(e)})
        return
    table_rows = [{**row, "tokens": row["target_tokens"]} for row in r["rows"]]
    table = report.format_table(table_rows, NO_MESH_COLUMNS if no_mesh else CODECS_COLUMNS)
    long = 4096 if 4096 in tokens else max(tokens)
    first = pair_list[0]["name"]
    lines = [table, ""]
    for p in r["pairs"]:
        cal = p["calibration"]
        lay = p["layout"]
        lines.append(f"pair {p['name']} ({p['sender_label']} -> {p['receiver_label']}, task {task}, {lay['num_layers']} "
                     f"layers, {lay['kv_heads']} KV heads x {lay['head_dim']}, hidden {lay['hidden']}): plan recompute "
                     f"[{p['group'][0]},{p['group'][1]}) ({p['group_source']}); SCD fit "
                     + (f"on {cal['contexts']} train contexts, {cal['tokens']} tokens, {cal['fit_s']:.0f} s" if cal
                        else "not run (no scd config)"))
    st = suite.scd_target(r["rows"], first, long)
    lines.append(f"SCD target ({first}, {long} tokens): wire bytes <= {st['max_bytes_vs_raw']:g} x raw at >= "
                 f"{1 - st['tolerance']:.0%} of full prefill's quality: "
                 + (f"{'MET' if st['met'] else 'NOT MET'} by {st['chosen']} (bytes_vs_raw {st['bytes_vs_raw']:.3f}, "
                    f"bytes_vs_raw_group {st['bytes_vs_raw_group']:.3f}, quality_vs_full {st['quality_vs_full']:.3f})"
                    if st["chosen"] else f"NOT MET: {st['why_none']}"))
    tg = suite.targets(r["rows"], first, None if no_mesh else target_rate, long)
    if no_mesh:
        lines.append("TTFT targets: not measured (--no-mesh)")
    else:
        lines += [f"targets ({first}, {target_rate:g} Gbit/s, {long} tokens): {tg['rule']}"]
        lines += [f"  {k} = {v}" for k, v in tg.items() if k not in ("rule",)]
    lines += [f"failure: {f}" for f in r["failures"]]
    lines.append(f"runtime {r['seconds']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in r['stage_seconds'].items())})")
    text = "\n".join(lines)
    click.echo(text)
    if table_path:
        Path(table_path).parent.mkdir(parents=True, exist_ok=True)
        Path(table_path).write_text(text + "\n")
    save(json_path, "codecs", {"task": task, "tokens": tokens, "rates_gbit": None if no_mesh else rates,
                                "repeats": repeats, "rows_scored": rows, "calibration_rows": calibration_rows, "dtype": dtype,
                                "codecs": codec_names, "shares": shares, "mesh": not no_mesh,
                                "chosen_rule": suite.CHOSEN_RULE, "targets": tg, "scd_target": st, "work_dir": work, **r})
    if plot_dir and no_mesh:
        click.echo("--plot-dir: no plots without TTFT (--no-mesh)", err=True)
    elif plot_dir:
        Path(plot_dir).mkdir(parents=True, exist_ok=True)
        for rate in rates:
            suite.plot(r["rows"], str(Path(plot_dir) / f"codecs-{rate:g}gbit.png"), rate, long)


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the summary and every request here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the agreement / score timeline PNG here.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Every process's log (default: a temporary directory).")
@click.option("--before", default="multihop_qa/plain", show_default=True, help="Task the pair is profiled on and served first.")
@click.option("--after", default="multihop_qa/coded", show_default=True, help="Task the workload shifts to.")
@click.option("--n-before", default=40, show_default=True, type=click.IntRange(1, 1000), help="Requests before the shift.")
@click.option("--n-settled", default=40, show_default=True, type=click.IntRange(1, 1000),
              help="Requests on the re-profiled config before stopping.")
@click.option("--max-shifted", default=200, show_default=True, type=click.IntRange(1, 2000),
              help="Requests after the shift at most (the run stops there if no new config came).")
@click.option("--profile-rows", default=8, show_default=True, type=click.IntRange(1, 200),
              help="Train and test rows of the first profile.")
@click.option("--threshold", default=0.4, show_default=True, type=click.FloatRange(0, 1),
              help="Receiver's quality_threshold (mean shadow token agreement that raises the alarm).")
@click.option("--window", default=20, show_default=True, type=click.IntRange(1, 1000), help="Receiver's quality_window.")
def drift(json_path, plot_path, log_dir, before, after, n_before, n_settled, max_shifted, profile_rows, threshold,
          window) -> None:
    """Quality watch: a pair profiled on one task, the workload shifting to another; requests to
    the alarm, to the re-profiled config, and the answers' score against full prefill per phase."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.errors import BadRequestError
    from droidmesh.shared.tools.bench import drift as suite
    from droidmesh.shared.zoo.manifest import REPO_ZOO, read_manifest, tier_models
    from droidmesh.shared.zoo.tiers import get_recipe

    root = REPO_ZOO / "demo"
    manifest = read_manifest(root)
    if manifest is None:
        raise BadRequestError(f"no committed demo tier at {root}; run `droidmesh zoo build --tier demo --out {root}`")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-drift-"))
    result = suite.run_drift(tier_models(root, manifest), get_recipe("demo").suite, logs, lambda s: click.echo(s, err=True),
                             before=before, after=after, n_before=n_before, n_settled=n_settled, max_shifted=max_shifted,
                             n_profile=profile_rows, threshold=threshold, window=window)
    click.echo(report.format_table(result["rows"], suite.COLUMNS))
    click.echo(f"alarm {result['requests_to_alarm']} and new config {result['requests_to_new_config']} requests after "
               f"the shift; plan {result.get('old_plan')} -> {result.get('new_plan')}; re-profile took "
               f"{result['reprofile_s']} s; logs in {logs}")
    save(json_path, "drift", result)
    if plot_path:
        suite.plot_png(result, plot_path)


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write both phases and every trial here.")
@click.option("--tokens", default=3000, show_default=True, type=click.IntRange(16, 4000),
              help="Context length (the demo models' filler words are one token each; they hold 4096 positions).")
@click.option("--trials", default=30, show_default=True, type=click.IntRange(4, 2000),
              help="Cached and as many uncached requests per phase; half of each train the threshold, half test it.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0, 100),
              help="Untimed cached + uncached pairs before each phase's trials.")
@click.option("--seed", default=0, show_default=True, type=int)
@launched_device_option
def sidechannel(json_path, tokens, trials, warmup, seed, device) -> None:
    """Timing side channel through the gateway: another tenant times its requests for cached and
    uncached contexts of a victim tenant; its best TTFT threshold's accuracy (95 % Wilson interval)
    before scopes (one tenant) and after (two)."""
    from droidmesh.shared.tools.bench import sidechannel as suite

    sender, receiver = demo_pair()
    layers = checkpoint_layers(receiver)
    # the demo pair's profiled group; a smaller receiver (the ci tier's) recomputes its upper half
    group = DEFAULT_GROUPS["base"] if layers >= DEFAULT_GROUPS["base"][1] else (layers // 2, layers)
    result = suite.run_sidechannel(sender, receiver, group, tokens, trials, warmup, seed, device,
                                   lambda m: click.echo(m, err=True))
    click.echo(report.format_table(suite.table_rows(result), suite.COLUMNS))
    for name, p in result["phases"].items():
        lo, hi = p["ci95"]
        click.echo(f"{name}: accuracy {p['accuracy']:.3f} on {p['test_trials']} test trials, 95% CI [{lo:.3f}, {hi:.3f}]"
                   f" {'contains' if p['chance_in_ci'] else 'excludes'} 0.5; paths {p['paths']}")
    save(json_path, "sidechannel", {"tokens": tokens, "trials_per_label": trials, "warmup": warmup, "seed": seed,
                                    "group": list(group), "sender": sender, "receiver": receiver, **result})


@bench.command()
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


@bench.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows here.")
@click.option("--docs", "n_docs", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Documents per kind of row (each asked twice).")
@click.option("--chars", default="7600,8400", show_default=True, callback=int_list,
              help="Document length range in characters (~2K SmolLM2 tokens at 8K).")
@click.option("--base", "base_arg", default="real/base", show_default=True, help="The base model (zoo name or directory).")
@click.option("--adapters", "adapter_args", default="real/docqa,real/summ,real/code", show_default=True,
              help="Comma list of PEFT adapters of the base served beside it.")
@click.option("--pairs", "pair_args", default="summ:docqa,base:summ", show_default=True,
              help="Comma list of FIRST:SECOND served ids of paired rows (the first request to FIRST, the second to "
                   "SECOND, whose pair config plans the reuse).")
@click.option("--group", type=GROUP, default=None,
              help="Recompute group 'start,end' of the pair when its tier has no servable saved profile.")
@click.option("--model", "model_arg", default="real-family/gemma", show_default=True,
              help="One more model served alone for same-model rows ('' for none; skipped when not built).")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep every process's log here.")
def held(json_path, n_docs, chars, base_arg, adapter_args, pair_args, group, model_arg, log_dir) -> None:
    """Reuse without ceremony: one receiver serving the real tier's base and adapters, no sender, no
    prefill command; TTFT of the second request over a document against its first (same model, and
    a paired adapter in process), and against the same plan with the KV already local."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.tools.bench import held as suite
    from droidmesh.shared.zoo.manifest import resolve_model

    if len(chars) != 2 or not 0 < chars[0] <= chars[1]:
        raise click.BadParameter(f"give 'LOW,HIGH' characters, got {chars}", param_hint="'--chars'")
    pairs = []
    for spec in (p.strip() for p in pair_args.split(",") if p.strip()):
        first, colon, second = spec.partition(":")
        if not (colon and first and second):
            raise click.BadParameter(f"{spec!r} is not FIRST:SECOND", param_hint="'--pairs'")
        pairs.append(Pair(first, second))
    try:
        base = resolve_model(base_arg)
        refs = [resolve_model(a.strip()) for a in adapter_args.split(",") if a.strip()]
    except DroidMeshError as e:
        raise click.UsageError(str(e)) from None
    logs = Path(log_dir or tempfile.mkdtemp(prefix="droidmesh-held-"))
    result = {"adapters": suite.run_adapters(base, refs, pairs, n_docs, logs / "adapters",
                                             chars=(chars[0], chars[1]), group=group)}
    if model_arg:
        try:
            model = resolve_model(model_arg)
        except DroidMeshError as e:
            click.echo(f"{model_arg}: {e}; its rows skipped", err=True)
        else:
            result["single"] = suite.run_single(model, n_docs, logs / "single", chars=(chars[0], chars[1]))
    rows = [r for part in result.values() for r in part["rows"]]
    click.echo(report.format_table(rows, suite.COLUMNS))
    for name, part in result.items():
        click.echo(f"{name}: {part['summary']}; holding: {part['holding']}")
    save(json_path, "held", {"when": suite.timestamp(), "log_dir": str(logs),
                             **{k: suite.strip(v) for k, v in result.items()}})


for _command in (*bench_data_plane.COMMANDS, *bench_peer.COMMANDS):
    bench.add_command(_command)
