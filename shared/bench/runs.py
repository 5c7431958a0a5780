"""Benchmarks that run the real mesh: processes, nats-server, UCX (and namespaces for bandwidth)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from shared.bench import netns
from shared.device import DEFAULT_DEVICE, DEVICE_ENV
from shared.launch import Proc, start_nats, start_service
from shared.wire.schemas import Mode

THREADS = {"OMP_NUM_THREADS": "1"}


def _on(device: str) -> dict[str, str]:
    """Environment of a launched model process: one torch thread, models on `device`. The
    services keep `dtype` bfloat16 given explicitly, on any device."""
    return {**THREADS, DEVICE_ENV: device}


def _probe(url: str, model: str, sender: str, tokens: int, group: tuple[int, int], repeats: int, device: str,
           wrap: list[str] | None = None) -> dict[str, Any]:
    argv = [*(wrap or []), sys.executable, "-m", "shared.bench.pipeline", "--nats", url, "--model", model,
            "--sender", sender, "--tokens", str(tokens), "--group", f"{group[0]},{group[1]}", "--repeats", str(repeats)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env={**os.environ, DEVICE_ENV: device})
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(f"probe failed ({out.returncode}):\n{out.stderr[-3000:]}")


def pipeline(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
             device: str = DEFAULT_DEVICE) -> dict[str, Any]:
    """The Fig. 13 ablation on loopback: one sender process, the probe as the receiver."""
    procs: list[Proc] = []
    try:
        nats, url = start_nats()
        procs.append(nats)
        procs.append(start_service("sender", {"model_path": sender_path, "model_id": "bench-sender",
                                              "dtype": "bfloat16", "e_layers": [group[0]]}, url, env=_on(device)))
        return _probe(url, receiver_path, "bench-sender", tokens, group, repeats, device)
    finally:
        for p in reversed(procs):
            p.stop()


def bandwidth(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
              rates_mbit: list[float | None], device: str = DEFAULT_DEVICE) -> list[dict[str, Any]]:
    """The probe in its own namespace, the sender (and NATS) in another, per link rate."""
    why = netns.available()
    if why:
        raise RuntimeError(f"bandwidth sweep skipped: {why}")
    rows = []
    with netns.link() as (snd, rcv):
        procs: list[Proc] = []
        try:
            nats, url = start_nats(host=netns.SND_IP, wrap=snd)
            procs.append(nats)
            procs.append(start_service("sender", {"model_path": sender_path, "model_id": "bench-sender",
                                                  "dtype": "bfloat16", "e_layers": [group[0]],
                                                  "ucx_host": netns.SND_IP}, url, env=_on(device), wrap=snd))
            for rate in tqdm(rates_mbit, desc="bandwidth", unit="rate"):
                netns.set_rate(rate)
                r = _probe(url, receiver_path, "bench-sender", tokens, group, repeats, device, wrap=rcv)
                r["configured_gbit_s"] = rate / 1000 if rate else None
                r["link_efficiency"] = r["achieved_gbit_s"] / (rate / 1000) if rate else None
                rows.append(r)
        finally:
            for p in reversed(procs):
                p.stop()
    return rows


# -- data plane ---------------------------------------------------------------------------------
async def _transfer(address: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    from shared.transport.bulk import make_client
    from shared.wire.schemas import PullItem, PullRequest

    client = make_client("ucx")
    await client.warm(address)
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        req = PullRequest(context_id=str(nbytes), items=[PullItem(0, "K")], token="")
        into = [torch.empty(n, dtype=torch.bfloat16)]  # the server's one bf16 tensor of nbytes
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            await client.pull(address, req, into, lambda *a: None, 60)
            times.append(time.perf_counter() - t0)
        src = torch.empty(n, dtype=torch.bfloat16)
        copies = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            src.clone()
            copies.append(time.perf_counter() - t0)
        ucx_s, copy_s = statistics.median(times[1:]), statistics.median(copies[1:])
        rows.append({"bytes": nbytes, "ucx_gb_s": nbytes / ucx_s / 1e9, "memcpy_gb_s": nbytes / copy_s / 1e9,
                     "ucx_over_memcpy": copy_s / ucx_s})
    await client.close()
    return rows


def transfer(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """UCX between two processes (a tensor server and this one) vs a memcpy of the same bytes."""
    server = subprocess.Popen([sys.executable, "-m", "shared.bench.tensor_server", ",".join(map(str, sizes))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **THREADS})
    try:
        address = server.stdout.readline().strip()  # type: ignore[union-attr]  # printed once listening
        return asyncio.run(_transfer(address, sizes, repeats))
    finally:
        server.terminate()
        server.wait(10)


# -- control plane ------------------------------------------------------------------------------
async def _control(url: str, n: int) -> dict[str, Any]:
    import nats

    from shared.wire import schemas, subjects

    nc = await nats.connect(url)
    fp = schemas.Fingerprint("llama", 12, 128, 4, 4, 32, "{}", "bench")
    hb = schemas.SenderHeartbeat(sender_id="bench", model_id="bench", context_ids=[], interval_s=3600, sent_at=time.time())
    await nc.publish(subjects.SENDER_HEARTBEAT, schemas.encode(hb))
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
        await nc.publish(subjects.CACHE_AVAILABLE, schemas.encode(ev))
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
    from shared.client import MeshClient

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
    from shared.client import MeshClient
    from shared.zoo import vocab

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
