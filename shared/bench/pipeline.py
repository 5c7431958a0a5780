"""Receiver-side probe for the pipelining ablation (DroidSpeak Fig. 13) and the bandwidth sweep.

Runs as its own process (`python -m droidmesh.shared.bench.pipeline ...`, possibly inside a network
namespace): asks a running sender to prefill a context of about `tokens` tokens, takes the
availability event, then times, for a recompute group [s, e):
  transfer    pull E_s + the reused KV only, no compute
  recompute   the engine with every tensor already local
  (a) all     pull E_s + every layer's KV, then compute
  (b) reused  pull E_s + the reused KV, then compute
  (c) piped   compute starts when E_s lands, reused KV streams meanwhile (the receiver's own
              path: `shared/transport/pull.py`'s pull and engine driver, one torch thread)
  prefill     the receiver's own full prefill (no transfer)
Every time is from the start of the pull (or compute) to the first token, median of repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from droidmesh.shared.device import DEVICE_ENV
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.kv.partial import generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.transport.pull import drive_engine, pull_into, pull_items, source_for
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.schemas import PullItem

QUESTION = " who"


async def probe(url: str, model_path: str, sender: str, tokens: int, group: tuple[int, int], repeats: int,
                device: str = "cpu") -> dict[str, Any]:
    import nats

    from droidmesh.shared.zoo import vocab

    model = load_model(model_path, dtype="bfloat16", device=device)
    nc = await nats.connect(url)
    events: asyncio.Queue = asyncio.Queue()

    async def on_available(msg: Any) -> None:
        await events.put(schemas.decode(msg.data, schemas.CacheAvailable))

    await nc.subscribe(subjects.CACHE_AVAILABLE_ALL, cb=on_available)
    # A fresh context per probe: a sender announces a context once, when it first captures it.
    rng = __import__("random").Random(time.time_ns())
    context = " ".join(rng.choice(vocab.FILLER) for _ in range(tokens))
    await nc.request(subjects.sender_prefill(sender), schemas.encode(
        schemas.PrefillRequest(request_id="probe", context=context)), timeout=300)
    ev: schemas.CacheAvailable = await asyncio.wait_for(events.get(), 60)
    await nc.close()
    if model.tokenizer is None:
        raise ConfigError(f"{model_path} has no tokenizer")
    prompt = list(ev.token_ids) + model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    L = model.num_layers
    plan = ReusePlan.recompute(*group)
    needed = pull_items(plan, L)  # E first (none for a group at layer 0: own embeddings), then reused KV
    every = [PullItem(layer=l, kind="E") for l in plan.e_layers] + [
        PullItem(layer=l, kind=k) for l in range(L) for k in ("K", "V")]
    bulk = make_client(ev.transport)
    await bulk.warm(ev.address)

    async def pull(items: list[PullItem], src: ArrivingSource | None) -> int:
        return await pull_into(bulk, ev, items, model, src, timeout_s=300)

    loop = asyncio.get_running_loop()
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def run_torch(fn: Any, *args: Any) -> Any:
        return await loop.run_in_executor(torch_thread, functools.partial(fn, *args))

    def engine(src: ArrivingSource, p: ReusePlan = plan) -> float:
        t0 = time.perf_counter()
        generate(model, prompt, p, src, max_new_tokens=1, timeout_s=300)
        return time.perf_counter() - t0

    async def run_mode(mode: str) -> float:
        src = source_for(ev)
        t0 = time.perf_counter()
        if mode == "transfer":
            await pull(needed, None)
        elif mode == "recompute":
            await pull(needed, src)
            return await loop.run_in_executor(None, engine, src)
        elif mode in ("all", "reused"):
            await pull(every if mode == "all" else needed, src)
            await loop.run_in_executor(None, engine, src)
        elif mode == "piped":
            pulling = loop.create_task(pull(needed, src))
            steps = generate_steps(model, prompt, plan, src, max_new_tokens=1, timeout_s=300)
            await drive_engine(steps, src, run_torch, {})
            await pulling
        else:  # prefill
            await loop.run_in_executor(None, lambda: generate(model, prompt, ReusePlan.full_prefill(), max_new_tokens=1))
        return time.perf_counter() - t0

    modes = ("transfer", "recompute", "all", "reused", "piped", "prefill")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats + 1):  # the first round warms caches and endpoints; dropped
        for m in modes:
            times[m].append(await run_mode(m))
    await bulk.close()
    torch_thread.shutdown()
    med = {m: statistics.median(v[1:]) for m, v in times.items()}
    reused_bytes = sum(ev.kv_nbytes[l] for l in plan.reused_layers(L)) + ev.e_nbytes
    return {"context_tokens": len(ev.token_ids), "group": list(group), "total_layers": L, "seconds": med,
            "reused_bytes": reused_bytes, "all_bytes": sum(ev.kv_nbytes) + ev.e_nbytes,
            "achieved_gbit_s": reused_bytes * 8 / med["transfer"] / 1e9,
            "pipeline_overhead": med["piped"] / max(med["recompute"], med["transfer"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sender", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group", default="0,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=os.environ.get(DEVICE_ENV, "cpu"))
    a = ap.parse_args(argv)
    s, e = (int(x) for x in a.group.split(","))
    out = asyncio.run(probe(a.nats, a.model, a.sender, a.tokens, (s, e), a.repeats, a.device))
    sys.stdout.write("PROBE " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
