"""`droidmesh bench codecs`' run: every wire codec / SCD config of each pair scored in process,
then timed over the mesh across a rate-limited link; the pieces are `codec_tradeoff`'s.

Called by `shared/cli/bench.py`. Three stages:
  1. in process, per pair: calibrate the SCD fit on train rows, write the maps every lowrank
     config needs, score every config on the test split, time its encode / decode per context
     length (`codec_tradeoff.quality`, `codec_seconds`);
  2. over the mesh, the bandwidth sweep's setup (`bandwidth`): sender and nats-server in one
     network namespace, the probe in the other, UCX over the tc-limited veth. Per pair a sender
     process starts, the pair's maps and config are published from the receiver's namespace
     (`python -m droidmesh.shared.bench.codec_tradeoff publish`), then per link rate the probe
     times every config at every context length (`probe.probe_configs`);
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
from pathlib import Path
from typing import Any

from tqdm import tqdm

from droidmesh.shared.bench import netns
from droidmesh.shared.bench.bandwidth import CROSS_HOST_UCX_TLS, bandwidth_env
from droidmesh.shared.bench.harness import PROBE_MODULE, launched_env, mesh, probe_env, probe_result
from droidmesh.shared.mesh.nats_auth import Roster, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import dies_with_parent, start_service


def _in_process(pairs: list[dict[str, Any]], tokens: list[int], rows: int, work: Path, task: str,
                calibration_rows: int, stage_s: dict[str, float]) -> list[dict[str, Any]]:
    """Stage 1: per pair its configs, maps, quality, codec timings, pair config and calibration."""
    from droidmesh.shared.bench import codec_tradeoff as bc
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import weights_sha256
    from droidmesh.shared.profiling import scd_fit
    from droidmesh.shared.profiling.profile import load_rows
    from droidmesh.shared.tasks.rows import encode_row
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec

    spec = task_spec(task)
    test_rows, train_rows = load_rows(task, "test", rows), load_rows(task, "train", calibration_rows)
    prepared: list[dict[str, Any]] = []
    for p in pairs:
        t0 = time.perf_counter()
        sender, receiver = (load_model(p[k], dtype="bfloat16") for k in ("sender", "receiver"))
        shas = {"sender_sha256": weights_sha256(Path(p["sender"])), "receiver_sha256": weights_sha256(Path(p["receiver"]))}
        contexts = [encode_row(receiver.tokenizer, r, spec)[0] for r in train_rows]
        fits = scd_fit.calibrate(sender, receiver, contexts, meta=shas, progress=False)
        L = receiver.num_layers
        cs = bc.configs(ReusePlan.recompute(*p["group"]), L)
        maps = bc.make_maps(fits, cs, work / "maps" / p["name"].replace(">", ""))
        q = bc.quality(PairScorer(sender, receiver, test_rows, spec), cs, maps)
        times = {t: bc.codec_seconds(sender, cs, maps, t) for t in tokens}
        cfg = bc.pair_config(cs, maps, q, f"bench-{p['name'].split('->')[0]}", p["name"].split("->")[1],
                             shas["sender_sha256"], shas["receiver_sha256"], task, L)
        prepared.append({"pair": p, "configs": cs, "maps": maps, "quality": q, "codec_s": times, "config": cfg,
                         "calibration": {"contexts": len(contexts), "tokens": fits.tokens, "fit_s": fits.fit_s}})
        stage_s[f"in_process {p['name']}"] = time.perf_counter() - t0
        del sender, receiver
        gc.collect()
    return prepared


def _over_the_mesh(prepared: list[dict[str, Any]], tokens: list[int], rates_gbit: list[float], repeats: int,
                   work: Path, device: str, ucx_tls: str | None, failures: list[str]
                   ) -> dict[tuple[str, int, float, str], dict[str, Any]]:
    """Stage 2: the probe's row per (pair, target tokens, link rate, config name)."""
    from droidmesh.shared.bench import codec_tradeoff as bc

    env = bandwidth_env("ucx", ucx_tls)
    found: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    senders = [prep["config"]["sender_model"] for prep in prepared]  # a sender per pair, its model's id its own
    with netns.link() as (snd, rcv), mesh(Roster.local(senders, []), host=netns.SND_IP, wrap=snd) as (access, procs):
        url = access.url
        bar = tqdm(total=len(prepared) * len(rates_gbit), desc="codecs over the mesh", unit="rate")
        for prep in prepared:
            p, cs = prep["pair"], prep["configs"]
            name = p["name"]
            e_layers = sorted({l for c in cs for l in c.plan.e_layers} | {0})
            model_id = prep["config"]["sender_model"]
            sproc = start_service("sender", {"model_path": p["sender"], "model_id": model_id, "sender_id": model_id,
                                              "dtype": "bfloat16", "e_layers": e_layers, "ucx_host": netns.SND_IP},
                                  url, env={**launched_env(device), **env, **access.env_for(sender_user(model_id))},
                                  wrap=snd)
            procs.append(sproc)
            tag = name.replace(">", "")
            cfg_path = work / f"config-{tag}.json"
            cfg_path.write_text(json.dumps(prep["config"]))
            seen = len(sproc.lines)
            pub = subprocess.run([*rcv, sys.executable, "-m", "droidmesh.shared.bench.codec_tradeoff", "publish", "--nats",
                                  url, "--config", str(cfg_path), "--maps", *sorted({f for _, f in prep["maps"].values()})],
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
                        p["receiver"], "--sender", prep["config"]["sender_model"], "--tokens",
                        ",".join(map(str, tokens)), "--repeats", str(repeats), "--configs", str(probe_path)]
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
               ucx_tls: str | None = CROSS_HOST_UCX_TLS) -> dict[str, Any]:
    """Per pair ({"name", "sender", "receiver", "group"}: checkpoint paths and the profiled
    recompute group), the configs of `codec_tradeoff.configs` through the three stages. Returns
    {"rows", "failures", "stage_seconds", "seconds", "pairs"}; rows carry every figure. Raises
    RuntimeError when namespaces are not available."""
    from droidmesh.shared.bench import codec_tradeoff as bc

    why = netns.available()
    if why:
        raise RuntimeError(f"codecs bench skipped: {why}")
    t_start = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stage_s: dict[str, float] = {}
    prepared = _in_process(pairs, tokens, rows, work, task, calibration_rows, stage_s)
    failures: list[str] = []
    t0 = time.perf_counter()
    measured = _over_the_mesh(prepared, tokens, rates_gbit, repeats, work, device, ucx_tls, failures)
    stage_s["mesh"] = time.perf_counter() - t0
    out_rows = []
    for prep in prepared:
        name = prep["pair"]["name"]
        for t in tokens:
            for rate in rates_gbit:
                for c in prep["configs"]:
                    m = measured.get((name, t, rate, c.name), {})
                    q = prep["quality"][c.name]
                    enc, dec, once = prep["codec_s"][t][c.name]
                    ctx = m.get("tokens")
                    nbytes = m.get("bytes_total")
                    out_rows.append({
                        "pair": name, "target_tokens": t, "tokens": ctx, "link_gbit": rate, "config": c.name,
                        "family": c.family, "codec": c.codec,
                        "codec_params": dict(bc.wire_of(c, prep["maps"].get(c.name, (None,))[0]).params),
                        "plan": c.plan.to_dict(), "share": c.share, "patch_share": c.patch_share,
                        "bytes_on_wire": nbytes / ctx if nbytes is not None and ctx else None,
                        "bytes_total": nbytes, "quality": q["quality"], "nll": q["nll"], "kl": q["kl"],
                        "top1": q["top1"], "encode_s": enc, "decode_s": dec, "prepare_s": once, "ttft_s": m.get("ttft_s"),
                        "rounds_s": m.get("rounds_s"), "error": m.get("error") if m else "not measured"})
    return {"rows": out_rows, "failures": failures, "stage_seconds": stage_s,
            "seconds": time.perf_counter() - t_start,
            "pairs": [{"name": prep["pair"]["name"], "group": list(prep["pair"]["group"]), "calibration": prep["calibration"],
                       "maps": {k: v[0] for k, v in prep["maps"].items()}} for prep in prepared]}
