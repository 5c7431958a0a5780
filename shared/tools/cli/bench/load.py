"""`droidmesh bench load`: a mesh under load — arrival rates against an SLO, concurrent
requests decoding together, or the agents workload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from droidmesh.shared import report
from droidmesh.shared.tools.cli.bench.kit import GROUP_HELP, demo_pair, launched_device_option, save
from droidmesh.shared.tools.cli.params import GROUP, float_list, int_list

if TYPE_CHECKING:
    from droidmesh.shared.tools.bench.load import ConcurrencyMode


@click.command()
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
    from droidmesh.shared.tools.bench.load import plot_load, run_load

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
        plot_load(rows, plot_path, slo)


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

    from droidmesh.shared.tools.bench.load import TextSource, plot_concurrency, run_concurrency
    from droidmesh.shared.tools.cli.bench.kit import model_pair
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
        plot_concurrency(r["rows"], plot_path)


COMMANDS = (load,)
