"""Benchmarks that run the real mesh: processes, nats-server, UCX (and namespaces for bandwidth)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from droidmesh.shared.bench import netns
from droidmesh.shared.bench.transfer import (
    KIB,
    MIB,
    UCX_GET,
    TensorServer,
    llc_bytes,
    memcpy_reference,
    pull_rates,
    ucx_protocol_for,
    ucx_tables,
)
from droidmesh.shared.model.device import DEFAULT_DEVICE, DEVICE_ENV
from droidmesh.shared.service.launch import Proc, start_nats, start_service
from droidmesh.shared.wire.schemas import Mode
from tqdm import tqdm

THREADS = {"OMP_NUM_THREADS": "1"}


def _on(device: str) -> dict[str, str]:
    """Environment of a launched model process: one torch thread, models on `device`. The
    services keep `dtype` bfloat16 given explicitly, on any device."""
    return {**THREADS, DEVICE_ENV: device}


def _probe(url: str, model: str, sender: str, tokens: int, group: tuple[int, int], repeats: int, device: str,
           wrap: list[str] | None = None, env: dict[str, str] | None = None,
           lines: list[str] | None = None) -> dict[str, Any]:
    """Run `shared.bench.pipeline` (under `wrap`, with `env` added); append its stdout to `lines`."""
    argv = [*(wrap or []), sys.executable, "-m", "droidmesh.shared.bench.pipeline", "--nats", url, "--model", model,
            "--sender", sender, "--tokens", str(tokens), "--group", f"{group[0]},{group[1]}", "--repeats", str(repeats)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **(env or {}), DEVICE_ENV: device})
    if lines is not None:
        lines.extend(out.stdout.splitlines())
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(f"probe failed ({out.returncode}):\n{out.stderr[-3000:]}")


def pipeline(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
             device: str = DEFAULT_DEVICE, transport: str = "ucx") -> dict[str, Any]:
    """The Fig. 13 ablation on one host: one sender process serving over `transport`, the probe
    as the receiver (it pulls over the channel the sender announces)."""
    procs: list[Proc] = []
    try:
        nats, url = start_nats()
        procs.append(nats)
        procs.append(start_service("sender", {"model_path": sender_path, "model_id": "bench-sender", "dtype": "bfloat16",
                                              "e_layers": [group[0]], "transport": transport}, url, env=_on(device)))
        return {**_probe(url, receiver_path, "bench-sender", tokens, group, repeats, device), "transport": transport}
    finally:
        for p in reversed(procs):
            p.stop()


# Two hosts share no memory: unless told otherwise, the bandwidth sweep's processes run UCX
# without its shared-memory transports. In two network namespaces of one kernel UCX still finds
# the peer on "this host" and, with CMA allowed (`shared/transport/ucx.py`), reads the sender's
# memory with process_vm_readv: the bytes never cross the veth and the tc limit measures nothing
# (15 Gbit/s "achieved" on a 0.5 Gbit/s link). An operator's UCX_TLS still wins.
CROSS_HOST_UCX_TLS = "tcp,self"
BANDWIDTH_PAYLOAD_BYTES = 1 << 20  # the size whose protocol row a bandwidth row reports (~ one layer's K or V)


def bandwidth_env(transport: str, ucx_tls: str | None) -> dict[str, str]:
    """Environment of the sweep's sender and probe: the bulk channel on both ends, UCX's protocol
    tables on stdout, and `ucx_tls` as UCX_TLS (None or "": the channel's own choice; an
    operator's UCX_TLS wins either way)."""
    env = {"DM_SENDER_TRANSPORT": transport, "DM_RECEIVER_TRANSPORT": transport, "UCX_PROTO_INFO": "y"}
    if ucx_tls:
        env["UCX_TLS"] = os.environ.get("UCX_TLS", ucx_tls)
    return env


def _row_ucx_transport(transport: str, sender_lines: list[str], probe_lines: list[str],
                       previous: str | None) -> str | None:
    """The UCX transport and protocol that carried this row's payloads (at 1 MiB, about one
    layer's K or V). ucx: the sender's last tag-send table printed during the row; UCX prints a
    table once per endpoint configuration, so a row whose endpoint matched an earlier one's
    keeps that row's answer. nixl: the probe's (a fresh process per row) get table."""
    if transport == "ucx":
        protocols = ucx_tables(sender_lines).get("host memory")
        if not protocols:
            return previous
    else:
        protocols = next(reversed(ucx_tables(probe_lines, UCX_GET).values()), None)  # the last, any memory type
        if not protocols:
            return None
    return ucx_protocol_for(BANDWIDTH_PAYLOAD_BYTES, protocols) or "unknown"


def bandwidth(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
              rates_mbit: list[float | None], device: str = DEFAULT_DEVICE, transport: str = "ucx",
              ucx_tls: str | None = CROSS_HOST_UCX_TLS) -> list[dict[str, Any]]:
    """The probe in its own namespace, the sender (and NATS) in another, per link rate, over
    `transport` (both ends). Each row adds `transport`, `ucx_transports` (what UCX carried the
    payloads with) and `ucx_tls` to the probe's figures."""
    why = netns.available()
    if why:
        raise RuntimeError(f"bandwidth sweep skipped: {why}")
    env = bandwidth_env(transport, ucx_tls)
    rows = []
    with netns.link() as (snd, rcv):
        procs: list[Proc] = []
        try:
            nats, url = start_nats(host=netns.SND_IP, wrap=snd)
            procs.append(nats)
            sender = start_service("sender", {"model_path": sender_path, "model_id": "bench-sender",
                                              "dtype": "bfloat16", "e_layers": [group[0]],
                                              "ucx_host": netns.SND_IP}, url, env={**_on(device), **env}, wrap=snd)
            procs.append(sender)
            chosen: str | None = None
            for rate in tqdm(rates_mbit, desc="bandwidth", unit="rate"):
                netns.set_rate(rate)
                seen, probe_lines = len(sender.lines), list[str]()
                r = _probe(url, receiver_path, "bench-sender", tokens, group, repeats, device, wrap=rcv, env=env,
                           lines=probe_lines)
                chosen = _row_ucx_transport(transport, sender.lines[seen:], probe_lines, chosen)
                r["configured_gbit_s"] = rate / 1000 if rate else None
                r["link_efficiency"] = r["achieved_gbit_s"] / (rate / 1000) if rate else None
                r.update(transport=transport, ucx_transports=chosen, ucx_tls=env.get("UCX_TLS"))
                rows.append(r)
        finally:
            for p in reversed(procs):
                p.stop()
    return rows


# -- data plane ---------------------------------------------------------------------------------
TRANSFER_SIZES = [256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
RATIO_FROM_BYTES = 16 * MIB  # `over_memcpy` / `ucx_over_memcpy`: the smallest ratio from this size up


def bench_transports() -> list[str]:
    """`bench transfer`'s default: every bulk channel that runs between processes (all of
    `bulk.TRANSPORTS` but inproc), so a channel added there is measured without a change here."""
    from droidmesh.shared.transport.bulk import TRANSPORTS

    return [t for t in TRANSPORTS if t != "inproc"]


async def _pull_inproc(sizes: list[int], repeats: int) -> dict[int, float]:
    """The in-process channel (no second process: the protocol's own cost, checksums included)."""
    from droidmesh.shared.bench.tensor_server import start_server, tensors_for

    server = start_server("inproc", tensors_for(sizes), name="bench-transfer")
    address = await server.start()
    try:
        return await pull_rates("inproc", address, sizes, repeats)
    finally:
        await server.close()


def _measure(transport: str, sizes: list[int], repeats: int, shm_lanes: int
             ) -> tuple[dict[int, float], dict[int, str | None], str | None]:
    """(GB/s per size, how each size travelled (UCX's transport and protocol; the shm copy; None
    where the channel does not say), None) or ({}, {}, reason)."""
    from droidmesh.shared.bench.tensor_server import one_line

    if transport == "inproc":
        try:
            return asyncio.run(_pull_inproc(sizes, repeats)), dict.fromkeys(sizes), None
        except Exception as e:
            return {}, {}, one_line(e)
    server = TensorServer(transport, sizes, env=THREADS)
    rates: dict[int, float] = {}
    reason = None
    try:
        server.wait_ready()
        if server.address is None:
            reason = server.error or "tensor server gave no address"
        else:
            rates = asyncio.run(pull_rates(transport, server.address, sizes, repeats, lanes=shm_lanes))
    except Exception as e:
        reason = one_line(e)
    finally:
        lines = server.stop()
    if reason is not None:
        return {}, {}, reason
    if transport == "shm":
        return rates, dict.fromkeys(sizes, f"memfd: preadv on {shm_lanes} lane(s)"), None
    if transport != "ucx":
        return rates, dict.fromkeys(sizes), None
    protocols = ucx_tables(lines).get("host memory", [])
    return rates, {n: ucx_protocol_for(n, protocols) or "unknown" for n in sizes}, None


def transfer(sizes: list[int], repeats: int, transports: list[str] | None = None, shm_lanes: int = 2) -> dict[str, Any]:
    """Pulls over each bulk channel between two processes (a tensor server and this one) against
    a memcpy of the same bytes (warm and out of cache). Returns `rows` (one per transport and
    size; a transport that cannot start is one row with `unavailable` and the reason),
    `over_memcpy` (per transport, the smallest ratio from 16 MiB up), `ucx_over_memcpy` and
    `memcpy` (how the reference was taken)."""
    transports = transports or bench_transports()
    llc = llc_bytes()
    refs = {}
    for n in sizes:  # before any server runs, so no other process competes for the cores
        refs[n] = memcpy_reference(n, repeats, llc)
        gc.collect()
    rows: list[dict[str, Any]] = []
    for transport in transports:
        rates, chosen, reason = _measure(transport, sizes, repeats, shm_lanes)
        if reason is not None:
            rows.append({"bytes": None, "transport": transport, "throughput_gb_s": None, "memcpy_gb_s": None,
                         "memcpy_cold_gb_s": None, "ratio": None, "ucx_transports": None, "unavailable": reason})
            continue
        for n in sizes:
            ref = refs[n]
            rows.append({"bytes": n, "transport": transport, "throughput_gb_s": rates[n], "memcpy_gb_s": ref["memcpy_gb_s"],
                         "memcpy_cold_gb_s": ref["memcpy_cold_gb_s"], "ratio": rates[n] / ref["memcpy_gb_s"],
                         "ucx_transports": chosen.get(n)})
    over: dict[str, float | None] = {}
    for transport in transports:
        ratios = [r["ratio"] for r in rows if r["transport"] == transport and r["ratio"] is not None
                  and r["bytes"] >= RATIO_FROM_BYTES]
        over[transport] = min(ratios) if ratios else None
    from droidmesh.shared.transport.memfd import shmem_thp
    from droidmesh.shared.transport.ucx import ucx_options

    return {"rows": rows, "ucx_over_memcpy": over.get("ucx"), "over_memcpy": over, "shm_lanes": shm_lanes, "shmem_thp": shmem_thp(),
            "memcpy": {"method": "torch.Tensor.copy_ into a preallocated destination, 1 thread, median of repeats",
                       "llc_bytes": llc, "cold_pairs": {str(n): refs[n]["cold_pairs"] for n in sizes}},
            "ucx_options": {**{f"UCX_{k}": v for k, v in ucx_options().items()},
                            **{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}}


# -- control plane ------------------------------------------------------------------------------
async def _control(url: str, n: int) -> dict[str, Any]:
    import nats
    from droidmesh.shared.wire import schemas, subjects

    nc = await nats.connect(url)
    fp = schemas.Fingerprint("llama", 12, 128, 4, 4, 32, "{}", "bench")
    hb = schemas.SenderHeartbeat(sender_id="bench", model_id="bench", context_ids=[], interval_s=3600, sent_at=time.time())
    await nc.publish(subjects.sender_heartbeat(hb.sender_id), schemas.encode(hb))
    rng = np.random.default_rng(0)
    visible, rtt = [], []
    for i in tqdm(range(n), desc="control", unit="event"):
        tokens = rng.integers(0, 50_000, 256).tolist()
        ev = schemas.CacheAvailable(sender_id="bench", model_id="bench", model_sha256="bench", fingerprint=fp,
                                    fingerprint_id="bench", context_id=f"c{i}", token_ids=tokens, dtype="bfloat16",
                                    kv_nbytes=[1] * 12, e_layers=[0], e_nbytes=1, transport="ucx",
                                    address="127.0.0.1:1", published_at=time.time())
        lookup = schemas.encode(schemas.LookupRequest(token_ids=tokens, fingerprint_id="bench"))
        t0 = time.perf_counter()
        await nc.publish(subjects.cache_available(ev.sender_id), schemas.encode(ev))
        while True:  # poll until the broker's index answers with it: an upper bound of event->index
            t1 = time.perf_counter()
            reply = schemas.decode((await nc.request(subjects.BROKER_LOOKUP, lookup, timeout=5)).data,
                                   schemas.LookupReply)
            t2 = time.perf_counter()
            if reply.holder is not None and reply.holder.context_id == f"c{i}":
                visible.append(t2 - t0)
                rtt.append(t2 - t1)
                break
    await nc.close()
    ms = lambda xs, q: float(np.percentile(np.array(xs) * 1e3, q))  # noqa: E731
    return {"events": n, "event_to_index_p50_ms": ms(visible, 50), "event_to_index_p99_ms": ms(visible, 99),
            "lookup_rtt_p50_ms": ms(rtt, 50), "lookup_rtt_p99_ms": ms(rtt, 99)}


def control(n: int) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        nats, url = start_nats()
        procs.append(nats)
        procs.append(start_service("cache_broker", {}, url, env=THREADS))
        return asyncio.run(_control(url, n))
    finally:
        for p in reversed(procs):
            p.stop()


# -- load ---------------------------------------------------------------------------------------
async def _load_rate(url: str, receiver: str, contexts: list[str], rate: float, seconds: float, mode: Mode,
                     slo_s: float, seed: int) -> dict[str, Any]:
    from droidmesh.shared.mesh.client import MeshClient

    client = await MeshClient.connect(url)
    rng = np.random.default_rng(seed)
    records: list[tuple[float, float, Any]] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        r = await client.ask(receiver, contexts[i % len(contexts)], f" who q{i}", max_new_tokens=8, mode=mode,
                             timeout=120, attempt_s=60)
        records.append((t0, time.perf_counter(), r))

    tasks, start, i = [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(rng.exponential(1.0 / rate))  # Poisson arrivals
    await asyncio.gather(*tasks)
    await client.close()
    ttft, tbt, e2e = [], [], []
    for t0, t1, r in records:
        decode_s = (r.stages_ms["done"] - r.stages_ms["first_token"]) / 1e3
        ttft.append(t1 - t0 - decode_s)  # client-side: queueing + lookup + transfer + prefill
        e2e.append(t1 - t0)
        if len(r.token_ids) > 1:
            tbt.append(decode_s / (len(r.token_ids) - 1))
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"rate": rate, "mode": mode, "requests": len(records), "seconds": seconds,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tbt_p50": pct(tbt, 50), "tbt_p99": pct(tbt, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
            "goodput": sum(1 for x in ttft if x <= slo_s) / seconds,
            "paths": sorted({r.path for _, _, r in records})}


def load(sender_path: str, receiver_path: str, group: tuple[int, int], tokens: int, rates: list[float],
         seconds: float, slo_s: float, copies: list[int], device: str = DEFAULT_DEVICE) -> list[dict[str, Any]]:
    """Poisson load against 1..N receiver copies, DroidMesh (auto) vs full prefill."""
    from droidmesh.shared.mesh.client import MeshClient
    from droidmesh.shared.zoo import vocab

    rng = np.random.default_rng(0)
    contexts = [" ".join(rng.choice(vocab.FILLER, tokens).tolist()) for _ in range(4)]
    rows = []
    for n in copies:
        procs: list[Proc] = []
        try:
            nats, url = start_nats()
            procs.append(nats)
            procs.append(start_service("cache_broker", {}, url, env=THREADS))
            procs.append(start_service("sender", {"model_path": sender_path, "model_id": "load-sender",
                                                  "dtype": "bfloat16", "e_layers": [group[0]]}, url,
                                       env=_on(device)))
            for k in range(n):
                procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "load-receiver",
                                                        "dtype": "bfloat16", "default_group": list(group)}, url,
                                           name=f"receiver{k}", env=_on(device)))

            async def prefill_all(url: str = url) -> None:
                client = await MeshClient.connect(url)
                for c in contexts:
                    await client.prefill("load-sender", c, timeout=300)
                for c in contexts:  # once per receiver copy's endpoint warm-up and until the broker sees them
                    await client.ask("load-receiver", c, " who", max_new_tokens=1, timeout=300)
                await client.close()

            asyncio.run(prefill_all())
            for rate in tqdm(rates, desc=f"load x{n}", unit="rate"):
                for mode in ("auto", "full_prefill"):
                    r = asyncio.run(_load_rate(url, "load-receiver", contexts, rate, seconds, mode, slo_s, seed=int(rate * 7)))
                    rows.append({"receivers": n, **r})
        finally:
            for p in reversed(procs):
                p.stop()
    return rows


# -- codecs (issue 13) ----------------------------------------------------------------------------
def codecs(pairs: list[dict[str, Any]], tokens: list[int], rates_gbit: list[float], repeats: int, rows: int,
           work_dir: str, task: str = "multihop_qa", calibration_rows: int = 16, device: str = DEFAULT_DEVICE,
           ucx_tls: str | None = CROSS_HOST_UCX_TLS) -> dict[str, Any]:
    """`droidmesh bench codecs`: per pair ({"name", "sender", "receiver", "group"}: checkpoint paths
    and the profiled recompute group), the configs of `shared.bench.codecs.configs` scored in
    process (quality, encode / decode seconds), then timed over the mesh at every link rate and
    context length (sender and NATS in one namespace, the probe in the other, UCX over the
    tc-limited veth). Returns {"rows", "pairs", "seconds"}; rows carry every figure."""
    from droidmesh.shared.bench import codecs as bc
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import weights_sha256
    from droidmesh.shared.profiling import scd_fit
    from droidmesh.shared.profiling.profile import load_rows
    from droidmesh.shared.tasks.rows import encode_row
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec

    why = netns.available()
    if why:
        raise RuntimeError(f"codecs bench skipped: {why}")
    t_start = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    spec = task_spec(task)
    test_rows, train_rows = load_rows(task, "test", rows), load_rows(task, "train", calibration_rows)
    prepared: list[dict[str, Any]] = []
    stage_s: dict[str, float] = {}
    # 1. in process: calibration, maps, quality on the test split, codec timings
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
    # 2. over the mesh
    env = bandwidth_env("ucx", ucx_tls)
    mesh: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    failures: list[str] = []
    t0 = time.perf_counter()
    with netns.link() as (snd, rcv):
        procs: list[Proc] = []
        try:
            nats, url = start_nats(host=netns.SND_IP, wrap=snd)
            procs.append(nats)
            bar = tqdm(total=len(prepared) * len(rates_gbit), desc="codecs over the mesh", unit="rate")
            for prep in prepared:
                p, cs = prep["pair"], prep["configs"]
                name = p["name"]
                e_layers = sorted({l for c in cs for l in c.plan.e_layers} | {0})
                sproc = start_service("sender", {"model_path": p["sender"], "model_id": prep["config"]["sender_model"],
                                                  "dtype": "bfloat16", "e_layers": e_layers,
                                                  "ucx_host": netns.SND_IP}, url, env={**_on(device), **env}, wrap=snd)
                procs.append(sproc)
                tag = name.replace(">", "")
                cfg_path = work / f"config-{tag}.json"
                cfg_path.write_text(json.dumps(prep["config"]))
                seen = len(sproc.lines)
                pub = subprocess.run([*rcv, sys.executable, "-m", "droidmesh.shared.bench.codecs", "publish", "--nats", url,
                                      "--config", str(cfg_path), "--maps", *sorted({f for _, f in prep["maps"].values()})],
                                     capture_output=True, text=True, timeout=300)
                if pub.returncode != 0:
                    raise RuntimeError(f"publishing {name}'s maps and config failed:\n{pub.stderr[-3000:]}")
                sproc.wait_for(lambda l: '"event": "config_loaded"' in l, 120, "the pair config loaded")
                failures += [f"{name}: sender: {l}" for l in sproc.lines[seen:] if "maps_unavailable" in l]
                probe_path = work / f"probe-{tag}.json"
                probe_path.write_text(json.dumps([bc.probe_config(c, prep["maps"]) for c in cs]))
                for rate in rates_gbit:
                    netns.set_rate(rate * 1000)
                    argv = [*rcv, sys.executable, "-m", "droidmesh.shared.bench.pipeline", "--nats", url, "--model",
                            p["receiver"], "--sender", prep["config"]["sender_model"], "--tokens",
                            ",".join(map(str, tokens)), "--repeats", str(repeats), "--configs", str(probe_path)]
                    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                                         env={**os.environ, **_on(device), **env})
                    line = next((l for l in out.stdout.splitlines() if l.startswith("PROBE ")), None)
                    if line is None:
                        failures.append(f"{name} at {rate:g} Gbit/s: probe failed ({out.returncode}): {out.stderr[-1500:]}")
                    else:
                        for r in json.loads(line[6:])["rows"]:
                            mesh[(name, r["target_tokens"], rate, r["config"])] = r
                    bar.update(1)
                sproc.stop()
                procs.remove(sproc)
            bar.close()
        finally:
            for proc in reversed(procs):
                proc.stop()
    stage_s["mesh"] = time.perf_counter() - t0
    # 3. one row per (pair, tokens, link, config)
    out_rows = []
    for prep in prepared:
        name = prep["pair"]["name"]
        for t in tokens:
            for rate in rates_gbit:
                for c in prep["configs"]:
                    m = mesh.get((name, t, rate, c.name), {})
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
