"""`droidmesh bench codecs`' run: every wire codec / SCD config of each pair scored in process,
then timed over the mesh across a rate-limited link; the pieces are `codec_tradeoff`'s.

Called by `shared/tools/cli/bench/`. Three stages:
  1. in process, per pair: calibrate the SCD fit on train rows (when a lowrank config is asked
     for), write the maps every lowrank config needs, score every config on the test split, time
     its encode / decode and count its payload bytes per context length (`codec_tradeoff.quality`,
     `codec_timing.codec_seconds`), against every layer sent raw and the profiled group's plan sent raw
     (`transfer.Layout.plan_bytes`);
  2. (unless `over_mesh=False`: `bench codecs --no-mesh`) over the mesh, the bandwidth sweep's
     setup (`bandwidth`): sender and nats-server in one network namespace, the probe in the other,
     UCX over the tc-limited veth. Per pair a sender process starts, the pair's maps and config
     (when it has lowrank configs) are published from the receiver's namespace (`python -m
     droidmesh.shared.tools.bench.codec_tradeoff publish`), then per link rate the probe times every
     config at every context length (`probe.probe_configs`);
  3. one row per (pair, context length, link rate, config) joining both.
Blocks for all of it (models load in this process; the mesh stage runs one probe per pair and
rate); every process is stopped and the namespaces removed on the way out. A probe that fails
is a failure line and rows without mesh figures, not an error; a publish that fails is an error.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from droidmesh.shared.mesh.nats_auth import Roster, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import dies_with_parent, start_service
from droidmesh.shared.service.localmesh import launched_env, mesh
from droidmesh.shared.tools.bench import netns
from droidmesh.shared.tools.bench.bandwidth import CROSS_HOST_UCX_TLS, bandwidth_env
from droidmesh.shared.tools.bench.harness import PROBE_MODULE, probe_env, probe_result


def _in_process(pairs: list[dict[str, Any]], tokens: list[int], rows: int, work: Path, task: str,
                calibration_rows: int, stage_s: dict[str, float], codecs: Sequence[str] | None = None,
                shares: Sequence[float] | None = None, dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """Stage 1: per pair its configs, maps, quality, codec timings and bytes, pair config (None
    without lowrank configs) and calibration."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import weights_sha256
    from droidmesh.shared.profiling import scd_fit
    from droidmesh.shared.profiling.datasets import load_rows
    from droidmesh.shared.profiling.transfer import Layout
    from droidmesh.shared.tasks.rows import encode_row
    from droidmesh.shared.tasks.scorer import RAW, PairScorer
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench import codec_tradeoff as bc
    from droidmesh.shared.tools.bench.codec_timing import codec_seconds

    spec = task_spec(task)
    test_rows = load_rows(task, "test", rows)
    prepared: list[dict[str, Any]] = []
    for p in pairs:
        name = p["name"]
        t0 = time.perf_counter()
        sender, receiver = (load_model(p[k], dtype=dtype) for k in ("sender", "receiver"))
        shas = {"sender_sha256": weights_sha256(Path(p["sender"])), "receiver_sha256": weights_sha256(Path(p["receiver"]))}
        L = receiver.num_layers
        group = ReusePlan.recompute(*p["group"])
        cs = bc.configs(group, L, tuple(bc.CODEC_CHOICES) if codecs is None else codecs, shares)
        t1 = time.perf_counter()
        fits = None
        if any(c.codec == "lowrank" for c in cs):  # the fit only serves lowrank configs
            train_rows = load_rows(task, "train", calibration_rows)
            contexts = [encode_row(receiver.tokenizer, r, spec)[0] for r in train_rows]
            kinds = ("K", "V", "E") if any(c.plan.patch for c in cs) else ("K", "V")  # E: patch configs only
            fits = scd_fit.calibrate(sender, receiver, contexts, meta=shas, progress=True, kinds=kinds)
        stage_s[f"calibrate {name}"] = time.perf_counter() - t1
        maps = bc.make_maps(fits, cs, work / "maps" / name.replace(">", "")) if fits is not None else {}
        t1 = time.perf_counter()
        q = bc.quality(PairScorer(sender, receiver, test_rows, spec), cs, maps)
        stage_s[f"quality {name}"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        times = {t: codec_seconds(sender, cs, maps, t) for t in tokens}
        stage_s[f"codec timings {name}"] = time.perf_counter() - t1
        layout = Layout.of(sender)
        raw_bytes = {t: {"group": layout.plan_bytes(group, RAW, t), "all": layout.plan_bytes(ReusePlan.full_reuse(), RAW, t)}
                     for t in tokens}
        sender_model, receiver_model = f"bench-{name.split('->')[0]}", name.split("->")[1]
        cfg = bc.pair_config(cs, maps, q, sender_model, receiver_model, shas["sender_sha256"], shas["receiver_sha256"],
                             task, L) if maps else None
        calibration = {"contexts": calibration_rows, "tokens": fits.tokens, "fit_s": fits.fit_s} if fits else None
        prepared.append({"pair": p, "configs": cs, "maps": maps, "quality": q, "codec_s": times, "raw_bytes": raw_bytes,
                         "config": cfg, "sender_model": sender_model, "calibration": calibration,
                         "layout": {"num_layers": L, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
                                    "hidden": layout.hidden, "dtype": str(layout.dtype).removeprefix("torch.")}})
        stage_s[f"in_process {name}"] = time.perf_counter() - t0
        del sender, receiver
        gc.collect()
    return prepared


def _over_the_mesh(prepared: list[dict[str, Any]], tokens: list[int], rates_gbit: list[float], repeats: int,
                   work: Path, device: str, ucx_tls: str | None, failures: list[str], dtype: str = "bfloat16"
                   ) -> dict[tuple[str, int, float, str], dict[str, Any]]:
    """Stage 2: the probe's row per (pair, target tokens, link rate, config name)."""
    from droidmesh.shared.tools.bench import codec_tradeoff as bc

    env = bandwidth_env("ucx", ucx_tls)
    found: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    senders = [prep["sender_model"] for prep in prepared]  # a sender per pair, its model's id its own
    with netns.link() as (snd, rcv), mesh(Roster.local(senders, []), host=netns.SND_IP, wrap=snd) as (access, procs):
        url = access.url
        bar = tqdm(total=len(prepared) * len(rates_gbit), desc="codecs over the mesh", unit="rate")
        for prep in prepared:
            p, cs = prep["pair"], prep["configs"]
            name = p["name"]
            e_layers = sorted({l for c in cs for l in c.plan.e_layers} | {0})
            model_id = prep["sender_model"]
            sproc = start_service("sender", {"model_path": p["sender"], "model_id": model_id, "sender_id": model_id,
                                              "dtype": dtype, "e_layers": e_layers, "ucx_host": netns.SND_IP},
                                  url, env={**launched_env(device), **env, **access.env_for(sender_user(model_id))},
                                  wrap=snd)
            procs.append(sproc)
            tag = name.replace(">", "")
            if prep["config"] is not None:  # lowrank configs: their maps and a pair config naming them
                cfg_path = work / f"config-{tag}.json"
                cfg_path.write_text(json.dumps(prep["config"]))
                seen = len(sproc.lines)
                pub = subprocess.run([*rcv, sys.executable, "-m", "droidmesh.shared.tools.bench.codec_tradeoff", "publish",
                                      "--nats", url, "--config", str(cfg_path),
                                      "--maps", *sorted({f for _, f in prep["maps"].values()})],
                                     capture_output=True, text=True, timeout=300, preexec_fn=dies_with_parent(),
                                     env={**os.environ, **access.env_for("profiler")})  # the role that writes both
                if pub.returncode != 0:
                    raise RuntimeError(f"publishing {name}'s maps and config failed:\n{pub.stderr[-3000:]}")
                sproc.wait_for(lambda l: '"event": "config_loaded"' in l, 120, "the pair config loaded")
                failures += [f"{name}: sender: {l}" for l in sproc.lines[seen:] if "maps_unavailable" in l]
            probe_path = work / f"probe-{tag}.json"
            probe_path.write_text(json.dumps([bc.probe_config(c, prep["maps"]) for c in cs]))
            for rate in rates_gbit:
                netns.set_rate(rate * 1000)
                argv = [*rcv, sys.executable, "-m", PROBE_MODULE, "--nats", url, "--model",
                        p["receiver"], "--sender", model_id, "--tokens",
                        ",".join(map(str, tokens)), "--repeats", str(repeats), "--configs", str(probe_path),
                        "--dtype", dtype]
                out = subprocess.run(argv, capture_output=True, text=True, timeout=3600, preexec_fn=dies_with_parent(),
                                     env={**os.environ, **launched_env(device), **env, **probe_env(access)})
                result = probe_result(out.stdout)
                if result is None:
                    failures.append(f"{name} at {rate:g} Gbit/s: probe failed ({out.returncode}): {out.stderr[-1500:]}")
                else:
                    for r in result["rows"]:
                        found[(name, r["target_tokens"], rate, r["config"])] = r
                bar.update(1)
            sproc.stop()
            procs.remove(sproc)
        bar.close()
    return found


def run_codecs(pairs: list[dict[str, Any]], tokens: list[int], rates_gbit: list[float], repeats: int, rows: int,
               work_dir: str, task: str = "multihop_qa", calibration_rows: int = 16, device: str = DEFAULT_DEVICE,
               ucx_tls: str | None = CROSS_HOST_UCX_TLS, codecs: Sequence[str] | None = None,
               shares: Sequence[float] | None = None, over_mesh: bool = True, dtype: str = "bfloat16"
               ) -> dict[str, Any]:
    """Per pair ({"name", "sender", "receiver", "group"}: checkpoint paths and the profiled
    recompute group), the configs of `codec_tradeoff.configs` (`codecs`, `shares`: which) through
    the three stages; `over_mesh=False` skips the mesh (no TTFT, no namespaces needed: rows have
    link_gbit None). `dtype`: the models' and so the wire's (bfloat16, as a sender serves on a GPU;
    float32 to compare with `droidmesh eval`, which scores in the CPU's float32). Returns {"rows",
    "failures", "stage_seconds", "seconds", "pairs"}; rows carry every figure. Raises
    RuntimeError when the mesh stage is asked for and namespaces are not available."""
    from droidmesh.shared.tools.bench import codec_tradeoff as bc

    why = netns.available() if over_mesh else None
    if why:
        raise RuntimeError(f"codecs bench skipped: {why} (--no-mesh measures all but TTFT without it)")
    t_start = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stage_s: dict[str, float] = {}
    prepared = _in_process(pairs, tokens, rows, work, task, calibration_rows, stage_s, codecs, shares, dtype)
    failures: list[str] = []
    measured: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    if over_mesh:
        t0 = time.perf_counter()
        measured = _over_the_mesh(prepared, tokens, rates_gbit, repeats, work, device, ucx_tls, failures, dtype)
        stage_s["mesh"] = time.perf_counter() - t0
    out_rows = []
    for prep in prepared:
        name = prep["pair"]["name"]
        full_q = next(prep["quality"][c.name]["quality"] for c in prep["configs"] if c.family == "full prefill")
        for t in tokens:
            raw = prep["raw_bytes"][t]
            for rate in (rates_gbit if over_mesh else [None]):
                for c in prep["configs"]:
                    m = measured.get((name, t, rate, c.name), {}) if rate is not None else {}
                    q = prep["quality"][c.name]
                    enc, dec, once, wire = prep["codec_s"][t][c.name]
                    ctx = m.get("tokens")
                    nbytes = m.get("bytes_total")
                    out_rows.append({
                        "pair": name, "target_tokens": t, "tokens": ctx, "link_gbit": rate, "config": c.name,
                        "family": c.family, "codec": c.codec,
                        "codec_params": dict(bc.wire_of(c, prep["maps"].get(c.name, (None,))[0]).params),
                        "plan": c.plan.to_dict(), "plan_label": c.plan.label(), "share": c.share,
                        "patch_share": c.patch_share,
                        "wire_bytes": wire / t, "bytes_vs_raw": wire / raw["all"], "bytes_vs_raw_group": wire / raw["group"],
                        "bytes_on_wire": nbytes / ctx if nbytes is not None and ctx else None,
                        "bytes_total": nbytes, "quality": q["quality"],
                        "quality_vs_full": q["quality"] / full_q if full_q else None, "nll": q["nll"], "kl": q["kl"],
                        "top1": q["top1"], "encode_s": enc, "decode_s": dec, "prepare_s": once, "ttft_s": m.get("ttft_s"),
                        "rounds_s": m.get("rounds_s"),
                        "error": m.get("error") if m else ("not measured" if over_mesh else "no mesh (--no-mesh)")})
    return {"rows": out_rows, "failures": failures, "stage_seconds": stage_s,
            "seconds": time.perf_counter() - t_start,
            "pairs": [{**{k: v for k, v in prep["pair"].items() if k != "group"}, "group": list(prep["pair"]["group"]),
                       "calibration": prep["calibration"], "layout": prep["layout"],
                       "raw_bytes_per_token": {t: {k: v / t for k, v in b.items()} for t, b in prep["raw_bytes"].items()},
                       "maps": {k: v[0] for k, v in prep["maps"].items()}} for prep in prepared]}
