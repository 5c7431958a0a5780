"""`droidmesh bench codecs`: every codec on the wire against quality and TTFT per pair and link
(with or without a mesh), and the options that name its pairs, codecs and shares.
"""

from __future__ import annotations

from typing import Any

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import DEFAULT_GROUP, DEFAULT_GROUPS, launched_device_option, save
from droidmesh.shared.tools.cli.params import GROUP, check_group, checkpoint_layers, float_list, int_list


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


def _codec_pairs(value: str, group: tuple[int, int] | None = None, hint: str = "'--pairs'") -> list[dict[str, Any]]:
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
            raise click.BadParameter(str(e), param_hint=hint) from None
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


@click.command()
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
    long = 4096 if 4096 in tokens else max(tokens)
    first = pair_list[0]["name"]
    st = suite.scd_target(r["rows"], first, long)
    tg = suite.targets(r["rows"], first, None if no_mesh else target_rate, long)
    lines = _summary(r, task, no_mesh, target_rate, long, first, st, tg)
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


def _summary(r: dict[str, Any], task: str, no_mesh: bool, target_rate: float, long: int, first: str,
             st: dict[str, Any], tg: dict[str, Any]) -> list[str]:
    """The printed report: the table, a line per pair (its layout, plan and SCD fit), the SCD and
    TTFT targets of the first pair, failures and the run's time."""
    table_rows = [{**row, "tokens": row["target_tokens"]} for row in r["rows"]]
    lines = [report.format_table(table_rows, NO_MESH_COLUMNS if no_mesh else CODECS_COLUMNS), ""]
    for p in r["pairs"]:
        cal = p["calibration"]
        lay = p["layout"]
        lines.append(f"pair {p['name']} ({p['sender_label']} -> {p['receiver_label']}, task {task}, {lay['num_layers']} "
                     f"layers, {lay['kv_heads']} KV heads x {lay['head_dim']}, hidden {lay['hidden']}): plan recompute "
                     f"[{p['group'][0]},{p['group'][1]}) ({p['group_source']}); SCD fit "
                     + (f"on {cal['contexts']} train contexts, {cal['tokens']} tokens, {cal['fit_s']:.0f} s" if cal
                        else "not run (no scd config)"))
    lines.append(f"SCD target ({first}, {long} tokens): wire bytes <= {st['max_bytes_vs_raw']:g} x raw at >= "
                 f"{1 - st['tolerance']:.0%} of full prefill's quality: "
                 + (f"{'MET' if st['met'] else 'NOT MET'} by {st['chosen']} (bytes_vs_raw {st['bytes_vs_raw']:.3f}, "
                    f"bytes_vs_raw_group {st['bytes_vs_raw_group']:.3f}, quality_vs_full {st['quality_vs_full']:.3f})"
                    if st["chosen"] else f"NOT MET: {st['why_none']}"))
    if no_mesh:
        lines.append("TTFT targets: not measured (--no-mesh)")
    else:
        lines += [f"targets ({first}, {target_rate:g} Gbit/s, {long} tokens): {tg['rule']}"]
        lines += [f"  {k} = {v}" for k, v in tg.items() if k not in ("rule",)]
    lines += [f"failure: {f}" for f in r["failures"]]
    lines.append(f"runtime {r['seconds']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in r['stage_seconds'].items())})")
    return lines


LAYERED_COLUMNS = ["wire", "int4_layers", "quality", "vs_full_prefill", "verdict", "vs_raw", "kl_nats",
                   "bytes_vs_raw_bf16", "bytes_vs_plan_raw"]


@click.command("layered")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the choice, every wire and row here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write quality against bytes (PNG) here.")
@click.option("--pair", "pair_spec", default="real/base:real/docqa", show_default=True,
              help="SENDER:RECEIVER, zoo names as `zoo list` prints them or checkpoint paths.")
@click.option("--group", type=GROUP, default=None,
              help="Recompute group START,END (default: the pair's saved profile's, as `bench codecs`).")
@click.option("--task", default="doc_qa", show_default=True, help="Task of the rows.")
@click.option("--probe-rows", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Train rows the per-layer choice reads its divergences on.")
@click.option("--rows", default=100, show_default=True, type=click.IntRange(1, 100000), help="Test rows scored per wire.")
@click.option("--slack", default=0.1, show_default=True, type=click.FloatRange(0, 10, max_open=True),
              help="Share of the plan's own divergence (sent raw) the codecs may add.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="float32", show_default=True,
              help="The models' dtype (float32 scores as `droidmesh eval` does on a CPU).")
@launched_device_option
def layered(json_path, plot_path, pair_spec, group, task, probe_rows, rows, slack, dtype, device) -> None:
    """The per-layer codec: int4 where the divergence allows, int8 elsewhere, chosen on train
    rows; quality with intervals and bytes against the plan sent raw, int8 and int4."""
    from droidmesh.shared.tools.bench import layered as suite

    pairs = _codec_pairs(pair_spec, group, "'--pair'")
    if len(pairs) != 1:
        raise click.BadParameter(f"{pair_spec!r}: one SENDER:RECEIVER", param_hint="'--pair'")
    pair = pairs[0]
    try:
        result = suite.run(pair["sender"], pair["receiver"], task, pair["group"], probe_rows, rows, slack, dtype, device,
                           lambda line: click.echo(line, err=True))
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None
    result["pair"], result["group_source"] = pair["name"], pair["group_source"]
    click.echo(report.format_table(suite.table_rows(result), LAYERED_COLUMNS))
    chosen = result["layered"]["chosen"]
    click.echo(f"int4 at layers {chosen['int4']} (group {chosen['group'] or 'default'}), E {chosen['e_codec']}: "
               f"{chosen['why']}")
    save(json_path, "layered", result)
    if plot_path:
        suite.plot(result, plot_path)


COMMANDS = (codecs, layered)
