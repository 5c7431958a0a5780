"""Receiver-side probe for the pipelining ablation (DroidSpeak Fig. 13) and the bandwidth sweep.

Runs as its own process (`python -m shared.bench.pipeline ...`, possibly inside a network
namespace): asks a running sender to prefill a context of about `tokens` tokens, takes the
availability event, then times, for a recompute group [s, e):
  transfer    pull E_s + the reused KV only, no compute
  recompute   the engine with every tensor already local
  (a) all     pull E_s + every layer's KV, then compute
  (b) reused  pull E_s + the reused KV, then compute
  (c) piped   compute starts when E_s lands, reused KV streams meanwhile
  prefill     the receiver's own full prefill (no transfer)
Every time is from the start of the pull (or compute) to the first token, median of repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import torch

from shared.kv.partial import generate
from shared.kv.plan import ReusePlan
from shared.kv.sources import ArrivingSource
from shared.model.adapter import ModelAdapter, load_model
from shared.model.fingerprint import ArchFingerprint
from shared.transport.tensors import DTYPES
from shared.transport.ucx import BulkClient
from shared.wire import schemas, subjects
from shared.wire.schemas import PullItem, PullRequest

QUESTION = " who"


async def _pull(bulk: BulkClient, ev: schemas.CacheAvailable, items: list[PullItem], model: ModelAdapter,
                source: ArrivingSource | None) -> int:
    tokens = len(ev.token_ids)

    def expected(it: PullItem):  # type: ignore[no-untyped-def]
        return list(model.e_shape(tokens) if it.kind == "E" else model.kv_shape(tokens)), DTYPES[ev.dtype]

    def on_tensor(it: PullItem, t: torch.Tensor) -> None:
        if source is not None:
            source.put(it.kind, it.layer, t)

    req = PullRequest(context_id=ev.context_id, items=items, token=ev.pull_token)
    return await bulk.pull(ev.ucx_host, ev.ucx_port, req, expected, on_tensor, timeout_s=300)


async def probe(url: str, model_path: str, sender: str, tokens: int, group: tuple[int, int], repeats: int
                ) -> dict[str, Any]:
    import nats

    from shared.zoo import vocab

    model = load_model(model_path, dtype="bfloat16")
    nc = await nats.connect(url)
    events: asyncio.Queue = asyncio.Queue()

    async def on_available(msg: Any) -> None:
        await events.put(schemas.decode(msg.data, schemas.CacheAvailable))

    await nc.subscribe(subjects.CACHE_AVAILABLE, cb=on_available)
    # A fresh context per probe: a sender announces a context once, when it first captures it.
    rng = __import__("random").Random(time.time_ns())
    context = " ".join(rng.choice(vocab.FILLER) for _ in range(tokens))
    await nc.request(subjects.sender_prefill(sender), schemas.encode(
        schemas.PrefillRequest(request_id="probe", context=context)), timeout=300)
    ev: schemas.CacheAvailable = await asyncio.wait_for(events.get(), 60)
    await nc.close()
    prompt = list(ev.token_ids) + model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    L = model.num_layers
    plan = ReusePlan.recompute(*group)
    reused = [PullItem(l, k) for l in plan.reused_layers(L) for k in ("K", "V")]
    every = [PullItem(l, k) for l in range(L) for k in ("K", "V")]
    first_e = [PullItem(group[0], "E")] if group[0] > 0 else []  # layer 0: own embeddings
    fp = ArchFingerprint.from_dict(__import__("msgspec").structs.asdict(ev.fingerprint))
    bulk = BulkClient()
    await bulk.warm(ev.ucx_host, ev.ucx_port)
    loop = asyncio.get_running_loop()

    def engine(src: ArrivingSource, p: ReusePlan = plan) -> float:
        t0 = time.perf_counter()
        generate(model, prompt, p, src, max_new_tokens=1, timeout_s=300)
        return time.perf_counter() - t0

    async def run_mode(mode: str) -> float:
        src = ArrivingSource(ev.token_ids, fp)
        t0 = time.perf_counter()
        if mode == "transfer":
            await _pull(bulk, ev, first_e + reused, model, None)
        elif mode == "recompute":
            await _pull(bulk, ev, first_e + reused, model, src)
            return await loop.run_in_executor(None, engine, src)
        elif mode in ("all", "reused"):
            await _pull(bulk, ev, first_e + (every if mode == "all" else reused), model, src)
            await loop.run_in_executor(None, engine, src)
        elif mode == "piped":
            pulling = loop.create_task(_pull(bulk, ev, first_e + reused, model, src))
            await loop.run_in_executor(None, engine, src)
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
    a = ap.parse_args(argv)
    s, e = (int(x) for x in a.group.split(","))
    out = asyncio.run(probe(a.nats, a.model, a.sender, a.tokens, (s, e), a.repeats))
    sys.stdout.write("PROBE " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
