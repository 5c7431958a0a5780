"""`droidmesh bench codecs`: how each wire codec / SCD config trades quality for TTFT; the pieces
of the run (`codec_sweep.run_codecs`), its targets and plots, and the publisher it launches.

Per pair (sender -> receiver on one task, any tier, the pair's profiled recompute group G), every
config of `configs` (the baselines, then the transfer search's candidates for G:
`shared/profiling/transfer.py::candidates`):
  quality      in process, on the test split, through the scorer's wires (`PairScorer.paths`):
               task score, gold-answer NLL, KL and top-1 agreement against the receiver's full prefill
  encode/decode  seconds per context to encode (sender, per pull) and decode (receiver) every item
               the config pulls, at each bench context length, CPU, one torch thread; for lowrank
               also `prepare_s`, the encode a sender does once when it stores a context, after
               which a pull's encode is a slice of the prepared codes (`codec_timing.codec_seconds`); and the
               payload bytes those items encode to (`wire_bytes`; against every layer's K/V sent raw,
               as full reuse does: `bytes_vs_raw`; against the profiled group's plan sent raw:
               `bytes_vs_raw_group`; no mesh needed)
  TTFT, bytes  over the mesh (`codec_sweep`): sender and receiver processes in two network
               namespaces, UCX over a tc-limited veth; the pipelined pull under the config's codec
               plus the engine to the first token (`probe.probe_configs`), and the payload bytes
               the pull moved
`choose` picks the SCD config the targets are about (`CHOSEN_RULE`); `targets` computes them;
`scd_target` checks wire bytes <= 1/4 of raw at >= 95 % of full prefill's quality (`SCD_TARGET_RULE`,
TTFT not needed); `pareto_front` marks the plots. The rest of this module runs in the `bench codecs` process
(quality, the maps files; the codec timings are `codec_timing`'s) or publishes maps and the pair config to the mesh
(`python -m droidmesh.shared.tools.bench.codec_tradeoff publish ...`, run inside the receiver's namespace).

Called by `codec_sweep` (configs, maps, scoring, timings, the probe's and the mesh's forms of a
config) and `shared/tools/cli/bench/` (targets, plots). Scoring and timing block on the CPU for as
long as the rows and context lengths take; `publish` blocks on NATS and checks the pair config
it is given (`config_board.validate`) before putting it on the board.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 0.05
CHOSEN_RULE = ("chosen = the lowrank config (family 'lowrank' or 'lowrank patch') with the lowest measured TTFT at "
               "the link rate and context length whose test quality >= (1 - 0.05) x the receiver's full prefill "
               "test quality; ties: fewer bytes on the wire")
LOWRANK_FAMILIES = ("lowrank", "lowrank patch")
FAMILIES = ("full prefill", "full reuse", "raw", "int8", "int4", "lowrank", "lowrank patch")


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to serve the pair: a plan and the wire codec its reused tensors travel under."""

    name: str
    family: str  # one of FAMILIES
    plan: Any  # ReusePlan
    codec: str = "raw"
    share: float | None = None  # lowrank: K/V variance kept
    patch_share: float | None = None  # lowrank: patch layers' E variance kept


# `--codecs` choices -> the config family each selects (the baselines, full prefill and full reuse raw, always run)
CODEC_CHOICES = {"raw": "raw", "int8": "int8", "int4": "int4", "scd": "lowrank", "scd-patch": "lowrank patch"}


def configs(group: Any, num_layers: int, codecs: Sequence[str] = tuple(CODEC_CHOICES),
            shares: Sequence[float] | None = None) -> list[Config]:
    """Every config measured for a pair whose profiled group is `group` (a ReusePlan): the
    receiver's full prefill, full reuse (raw), then the transfer search's candidates for the group
    (raw, int8, int4, lowrank at each share, patch configs), those of the families `codecs`
    names (`CODEC_CHOICES`) only; `shares`: the lowrank K/V shares (default the transfer
    search's). One function, so the list can change in one place."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.profiling import transfer

    unknown = sorted(set(codecs) - set(CODEC_CHOICES))
    if unknown:
        raise ValueError(f"unknown codec choice(s) {unknown}; expected some of {list(CODEC_CHOICES)}")
    families = {CODEC_CHOICES[c] for c in codecs}
    settings = transfer.Settings() if shares is None else dataclasses.replace(transfer.Settings(), shares=tuple(shares))
    out = [Config("full prefill", "full prefill", ReusePlan.full_prefill()),
           Config("full reuse raw", "full reuse", ReusePlan.full_reuse())]
    for c in transfer.candidates(group, num_layers, settings):
        family = "lowrank patch" if c.codec == "lowrank" and c.plan.patch else c.codec
        if family in families:
            out.append(Config(c.name, family, c.plan, c.codec, c.share, c.patch_share))
    return out


# -- pure: the Pareto front, the chosen config, the targets ---------------------------------------
def pareto_front(points: Sequence[tuple[float | None, float | None]]) -> list[int]:
    """Indices of the (ttft, quality) points no other point dominates (at most the TTFT and at
    least the quality, better in one), ascending TTFT; points with a None are left out."""
    ok = [(i, t, q) for i, (t, q) in enumerate(points) if t is not None and q is not None]
    front = [i for i, t, q in ok
             if not any((t2 <= t and q2 >= q) and (t2 < t or q2 > q) for _, t2, q2 in ok)]
    return sorted(front, key=lambda i: (points[i][0], -(points[i][1] or 0.0)))


def choose(rows: Sequence[dict[str, Any]], full_quality: float, tolerance: float = TOLERANCE) -> dict[str, Any] | None:
    """The row `CHOSEN_RULE` picks among `rows` (one pair, link rate and context length), or None."""
    ok = [r for r in rows if r.get("family") in LOWRANK_FAMILIES and r.get("ttft_s") is not None
          and r.get("quality") is not None and r["quality"] >= (1 - tolerance) * full_quality]
    return min(ok, key=lambda r: (r["ttft_s"], r.get("bytes_on_wire") or 0)) if ok else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


MAX_BYTES_VS_RAW = 0.25
SCD_TARGET_RULE = ("SCD target: among the lowrank configs (family 'lowrank' or 'lowrank patch'), the one with the fewest "
                   "wire bytes whose test quality >= (1 - 0.05) x the receiver's full prefill test quality; met when its "
                   "wire bytes <= 1/4 of every layer's K/V sent raw (bytes_vs_raw, full reuse raw: the SCD target's "
                   "raw; bytes_vs_raw_group: against the profiled group's plan sent raw, reported). Bytes: the encoded "
                   "payload at the context length, per token; no TTFT needed")


def scd_target(rows: Sequence[dict[str, Any]], pair: str, tokens: int, tolerance: float = TOLERANCE,
               max_bytes_vs_raw: float = MAX_BYTES_VS_RAW) -> dict[str, Any]:
    """`SCD_TARGET_RULE` for `pair` at target context length `tokens` (quality and bytes do not
    depend on the link rate: the first row per config is taken). Rows need `bytes_vs_raw`,
    `bytes_vs_raw_group` and `quality` (`codec_sweep.run_codecs`' rows)."""
    here: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["pair"] == pair and r["target_tokens"] == tokens:
            here.setdefault(r["config"], r)
    out: dict[str, Any] = {"rule": SCD_TARGET_RULE, "pair": pair, "tokens": tokens, "tolerance": tolerance,
                           "max_bytes_vs_raw": max_bytes_vs_raw, "chosen": None, "met": False}
    full = next((r for r in here.values() if r["family"] == "full prefill"), None)
    if full is None or full.get("quality") is None:
        out["why_none"] = "no full prefill row"
        return out
    out["full_prefill_quality"] = full["quality"]
    scd = [r for r in here.values() if r["family"] in LOWRANK_FAMILIES and r.get("bytes_vs_raw") is not None]
    if not scd:
        out["why_none"] = "no lowrank config measured (--codecs scd or scd-patch)"
        return out
    ok = [r for r in scd if r.get("quality") is not None and r["quality"] >= (1 - tolerance) * full["quality"]]
    best = max(scd, key=lambda r: (r.get("quality") or 0.0, -r["bytes_vs_raw"]))
    out["best_quality"] = {"config": best["config"], "quality_vs_full": best.get("quality_vs_full"),
                           "bytes_vs_raw": best["bytes_vs_raw"]}
    if not ok:
        out["why_none"] = f"no lowrank config within {tolerance:g} of full prefill's quality"
        return out
    c = min(ok, key=lambda r: (r["bytes_vs_raw"], -(r.get("quality") or 0.0)))
    out.update(chosen=c["config"], plan=c.get("plan"), quality=c["quality"], quality_vs_full=c.get("quality_vs_full"),
               kl=c.get("kl"), top1=c.get("top1"), wire_bytes=c.get("wire_bytes"), bytes_vs_raw=c["bytes_vs_raw"],
               bytes_vs_raw_group=c.get("bytes_vs_raw_group"), met=c["bytes_vs_raw"] <= max_bytes_vs_raw)
    return out


def targets(rows: Sequence[dict[str, Any]], pair: str, link_gbit: float | None, tokens: int,
            tolerance: float = TOLERANCE, saved_link_gbit: float = 1.0) -> dict[str, Any]:
    """The suite's target figures for `pair` at `link_gbit` and target context length `tokens`:
    speedups of the chosen SCD config vs full prefill and vs the raw profiled group (TTFT),
    its quality / full prefill's, its wire bytes / all layers raw (full reuse), and its
    encode + decode seconds / the transfer time it saves against the raw group at `saved_link_gbit`."""
    here = [r for r in rows if r["pair"] == pair and r["link_gbit"] == link_gbit and r["target_tokens"] == tokens]
    by_family = {f: next((r for r in here if r["family"] == f), None) for f in ("full prefill", "full reuse", "raw")}
    full, raw_all, raw_group = by_family["full prefill"], by_family["full reuse"], by_family["raw"]
    out: dict[str, Any] = {"pair": pair, "link_gbit": link_gbit, "tokens": tokens, "rule": CHOSEN_RULE,
                           "chosen": None, "scd_speedup_vs_full_prefill": None, "scd_speedup_vs_raw_group": None,
                           "scd_quality_ratio": None, "scd_bytes_ratio": None,
                           f"encode_decode_share_of_saved_transfer_{saved_link_gbit:g}gbit": None}
    if full is None or full.get("quality") is None:
        out["why_none"] = "no full prefill row"
        return out
    c = choose(here, full["quality"], tolerance)
    if c is None:
        out["why_none"] = "no lowrank config within tolerance with a measured TTFT"
        return out
    out.update(chosen=c["config"], chosen_ttft_s=c["ttft_s"], chosen_quality=c["quality"],
               chosen_bytes_on_wire=c.get("bytes_on_wire"),
               scd_speedup_vs_full_prefill=_ratio(full.get("ttft_s"), c["ttft_s"]),
               scd_speedup_vs_raw_group=_ratio(raw_group.get("ttft_s") if raw_group else None, c["ttft_s"]),
               scd_quality_ratio=_ratio(c["quality"], full["quality"]),
               scd_bytes_ratio=_ratio(c.get("bytes_on_wire"), raw_all.get("bytes_on_wire") if raw_all else None))
    saved = None
    if raw_group and raw_group.get("bytes_total") is not None and c.get("bytes_total") is not None:
        saved = (raw_group["bytes_total"] - c["bytes_total"]) * 8 / (saved_link_gbit * 1e9)
    codec_s = (c["encode_s"] + c["decode_s"]) if c.get("encode_s") is not None and c.get("decode_s") is not None else None
    out[f"encode_decode_share_of_saved_transfer_{saved_link_gbit:g}gbit"] = (
        codec_s / saved if codec_s is not None and saved and saved > 0 else None)
    out["saved_transfer_s"] = saved
    out["encode_decode_s"] = codec_s  # per pull (encode: a slice of the codes prepared when the context was stored)
    out["prepare_s"] = c.get("prepare_s")  # the encode paid once per stored context
    return out


# -- in process: maps, quality ---------------------------------------------------------------------
def wire_of(c: Config, maps_sha: str | None) -> Any:
    from droidmesh.shared.tasks.scorer import RAW, Wire
    from droidmesh.shared.transport import codecs as wire_codecs

    if c.codec == "raw":
        return RAW
    if c.codec == "lowrank":
        return Wire.of("lowrank", {wire_codecs.MAPS_PARAM: maps_sha or ""})
    return Wire.of(c.codec)


def make_maps(pair_fits: Any, cs: Sequence[Config], out_dir: Path) -> dict[str, tuple[str, str]]:
    """Maps for every lowrank config, registered with this process's `lowrank` codec and written
    to `out_dir/<sha256>.safetensors`: {config name: (sha256, path)}."""
    from droidmesh.shared.profiling import scd_fit
    from droidmesh.shared.transport import codecs as wire_codecs

    out_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for c in cs:
        if c.codec != "lowrank":
            continue
        assert c.share is not None
        maps, data = scd_fit.maps_for(pair_fits, c.plan, c.share, c.patch_share)
        wire_codecs.LOWRANK.add_maps(maps)
        path = out_dir / f"{maps.sha256}.safetensors"
        path.write_bytes(data)
        found[c.name] = (maps.sha256, str(path))
    return found


def quality(scorer: Any, cs: Sequence[Config], maps: dict[str, tuple[str, str]], progress: bool = True
            ) -> dict[str, dict[str, float]]:
    """Per config name: mean task score, gold-answer NLL, KL and top-1 agreement vs the receiver's
    full prefill, over the scorer's rows (full prefill itself: KL 0)."""
    from droidmesh.shared.tasks import measures

    plans = {c.name: c.plan for c in cs if c.family != "full prefill"}
    wires = {c.name: wire_of(c, maps.get(c.name, (None,))[0]) for c in cs if c.family != "full prefill"}
    acc: dict[str, dict[str, list[float]]] = {c.name: {"quality": [], "nll": [], "kl": [], "top1": []} for c in cs}
    full_name = next(c.name for c in cs if c.family == "full prefill")
    for res in scorer.paths(plans, wires=wires, progress=progress, sender_alone=False):
        ref = res["receiver_full_prefill"]
        for name in acc:
            r = ref if name == full_name else res[name]
            a = acc[name]
            a["quality"].append(r.quality)
            a["nll"].append(r.nll)
            a["kl"].append(measures.kl_divergence(ref.logits, r.logits))
            a["top1"].append(measures.top1_agreement(ref.logits, r.logits))
    return {name: {k: statistics.fmean(v) for k, v in a.items()} for name, a in acc.items()}


def probe_config(c: Config, maps: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The probe's form of a config (`probe.load_probe_configs`)."""
    sha, path = maps.get(c.name, (None, None))
    return {"name": c.name, "plan": c.plan.to_dict(), "codec": c.codec,
            "codec_params": dict(wire_of(c, sha).params), "maps_file": path}


def pair_config(cs: Sequence[Config], maps: dict[str, tuple[str, str]], q: dict[str, dict[str, float]],
                sender_model: str, receiver_model: str, sender_sha: str, receiver_sha: str, task: str,
                num_layers: int) -> dict[str, Any]:
    """A RecomputeConfig (as a dict) whose frontier names every lowrank config's maps: what makes
    a sender service load them (`services/sender/handlers.py::on_config`)."""
    from droidmesh.shared.kv import policy
    from droidmesh.shared.transport import codecs as wire_codecs

    points = []
    for c in cs:
        if c.name not in maps:
            continue
        spec = policy.spec_of(c.plan, "lowrank", {wire_codecs.MAPS_PARAM: maps[c.name][0]})
        points.append({"plan": {"groups": [list(g) for g in spec.groups], "codec": spec.codec,
                                "codec_params": spec.codec_params, "patch_layers": spec.patch_layers},
                       "recomputed_layers": len(c.plan.recomputed_layers(num_layers)),
                       "quality": q[c.name]["quality"]})
    full = next(c.name for c in cs if c.family == "full prefill")
    reuse = next(c.name for c in cs if c.family == "full reuse")
    return {"sender_model": sender_model, "receiver_model": receiver_model, "sender_sha256": sender_sha,
            "receiver_sha256": receiver_sha, "profile_version": int(time.time()), "task": task,
            "tolerance": TOLERANCE, "chosen": points[0], "frontier": points,
            "full_prefill_quality": q[full]["quality"], "full_reuse_quality": q[reuse]["quality"],
            "total_layers": num_layers, "created_at": time.time()}


async def publish(url: str, config_path: str, maps_files: Sequence[str]) -> None:
    """Put the maps files in the mesh's maps store, then the pair config on the config board (as
    the user `DM_NATS_USER` names, if any: the profiler, the role that writes both)."""
    import msgspec
    import nats

    from droidmesh.shared.mesh.config_board import NatsConfigBoard, validate
    from droidmesh.shared.mesh.maps_store import NatsMapsStore
    from droidmesh.shared.mesh.nats_auth import env_login
    from droidmesh.shared.wire import schemas

    nc = await nats.connect(url, **env_login())
    try:
        store = NatsMapsStore(nc)
        for f in maps_files:
            await store.put(Path(f).read_bytes())
        cfg = msgspec.convert(json.loads(Path(config_path).read_text()), schemas.RecomputeConfig)
        await NatsConfigBoard(nc).put(validate(cfg))
    finally:
        await nc.close()


def plot(rows: Sequence[dict[str, Any]], path: str, link_gbit: float, tokens: int) -> None:
    """Quality vs TTFT at `link_gbit` and target length `tokens`: every pair, a marker per config
    family, each pair's Pareto front as a step line."""
    from droidmesh.shared import report

    plt = report.pyplot()

    markers = dict(zip(FAMILIES, ("s", "v", "o", "^", "<", "*", "P"), strict=True))
    here = [r for r in rows if r["link_gbit"] == link_gbit and r["target_tokens"] == tokens]
    pairs = list(dict.fromkeys(r["pair"] for r in here))
    colors = dict(zip(pairs, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for pair in pairs:
        rs = [r for r in here if r["pair"] == pair]
        for fam in FAMILIES:
            fr = [r for r in rs if r["family"] == fam and r.get("ttft_s") is not None]
            if fr:
                ax.scatter([r["ttft_s"] for r in fr], [r["quality"] for r in fr], marker=markers[fam], s=45,
                           color=colors.get(pair), label=f"{pair}: {fam}", alpha=0.8)
        front = [rs[i] for i in pareto_front([(r.get("ttft_s"), r.get("quality")) for r in rs])]
        if front:
            xs, ys = [r["ttft_s"] for r in front], [r["quality"] for r in front]
            ax.step(xs, ys, where="post", color=colors.get(pair), lw=1, ls="--")
            ax.scatter(xs, ys, s=150, facecolors="none", edgecolors=colors.get(pair), lw=1.2,
                       label=f"{pair}: Pareto front (ringed)")
            report.label_points(ax, xs, ys, "{:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT (s, ~{tokens} context tokens, {link_gbit:g} Gbit/s link, median)")
    ax.set_ylabel("quality (test split, task metric)")
    ax.set_title(f"codecs / SCD configs at {link_gbit:g} Gbit/s")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Publish SCD maps and a pair config to a mesh (bench codecs).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish")
    p.add_argument("--nats", required=True)
    p.add_argument("--config", required=True, help="a RecomputeConfig as JSON")
    p.add_argument("--maps", nargs="*", default=[], help="maps files to put in the maps store")
    a = ap.parse_args(argv)
    asyncio.run(publish(a.nats, a.config, a.maps))
    print("PUBLISHED", flush=True)


if __name__ == "__main__":
    main()
