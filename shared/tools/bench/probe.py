"""The receiver-side probe of `droidmesh bench pipeline`, `bench bandwidth` and `bench codecs`.

Runs as its own process (`python -m droidmesh.shared.tools.bench.probe ...`, launched by
`harness.run_probe` or `codec_sweep`, possibly inside a network namespace) and prints one line,
"PROBE " and its JSON result. It logs in as the harness says (`DM_NATS_USER` / `DM_NATS_PASSWORD`:
an operator, which may fill a sender's store and take its pull grants). It asks a running sender to prefill a context of about `tokens`
tokens, takes the availability event, then times, for a recompute group [s, e), whether
overlapping the pull with the compute pays:
  transfer    pull E_s + the reused KV only, no compute
  recompute   the engine with every tensor already local
  (a) all     pull E_s + every layer's KV, then compute
  (b) reused  pull E_s + the reused KV, then compute
  (c) piped   compute starts when E_s lands, reused KV streams meanwhile (the receiver's own
              path: `shared/transport/pull.py`'s pull, `shared/service/engine.py`'s driver, one torch thread)
  prefill     the receiver's own full prefill (no transfer)
Every time is from the start of the pull (or compute) to the first token, median of repeats.

With `--configs FILE` it is the codecs probe (`droidmesh bench codecs`, `probe_configs`): for each
context length in `--tokens` (a comma list) one fresh context, then every listed config (a plan,
patch layers included, a wire codec and its params, the maps file a lowrank config needs) is
timed on that same context: pipelined pull under the config's codec + engine to the first token
(full prefill: the engine alone), median of repeats, the first round dropped.
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

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.kv.partial import generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.mesh.nats_auth import env_login
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.device import DEVICE_ENV
from droidmesh.shared.service.engine import drive_engine
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.transport.pull import pull_into, pull_items, request_grant, requester, source_for
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.schemas import PullItem

QUESTION = " who"


async def probe(url: str, model_path: str, sender: str, tokens: int, group: tuple[int, int], repeats: int,
                device: str = "cpu") -> dict[str, Any]:
    import nats

    from droidmesh.shared.tasks import vocab

    model = load_model(model_path, dtype="bfloat16", device=device)
    nc = await nats.connect(url, **env_login())  # the login the harness gave this process, if any
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
        token = await request_grant(requester(nc), ev, 10)  # one single-use grant per pull, as a receiver does
        return await pull_into(bulk, ev, items, model, src, timeout_s=300, token=token)

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
    await nc.close()
    torch_thread.shutdown()
    med = {m: statistics.median(v[1:]) for m, v in times.items()}
    reused_bytes = sum(ev.kv_nbytes[l] for l in plan.reused_layers(L)) + ev.e_nbytes
    return {"context_tokens": len(ev.token_ids), "group": list(group), "total_layers": L, "seconds": med,
            "reused_bytes": reused_bytes, "all_bytes": sum(ev.kv_nbytes) + ev.e_nbytes,
            "achieved_gbit_s": reused_bytes * 8 / med["transfer"] / 1e9,
            "pipeline_overhead": med["piped"] / max(med["recompute"], med["transfer"])}


async def _fresh_context(nc: Any, events: asyncio.Queue, sender: str, tokens: int) -> schemas.CacheAvailable:
    """Have `sender` prefill a fresh filler context of about `tokens` tokens; its availability event."""
    from droidmesh.shared.tasks import vocab

    rng = __import__("random").Random(time.time_ns())
    context = " ".join(rng.choice(vocab.FILLER) for _ in range(tokens))
    await nc.request(subjects.sender_prefill(sender), schemas.encode(
        schemas.PrefillRequest(request_id=f"probe-{tokens}", context=context)), timeout=300)
    return await asyncio.wait_for(events.get(), 60)


def plan_from_dict(d: dict[str, Any]) -> ReusePlan:
    """The inverse of `ReusePlan.to_dict`."""
    return ReusePlan(d["mode"], tuple((int(a), int(b)) for a, b in d.get("groups", ())), float(d.get("ratio", 0.0)),
                     tuple(int(l) for l in d.get("patch", ())))


def load_probe_configs(path: str) -> list[dict[str, Any]]:
    """The configs file `probe_configs` takes: a JSON list of {"name", "plan" (`ReusePlan.to_dict`),
    "codec", "codec_params", "maps_file" (lowrank: the maps file; else null)}."""
    with open(path) as f:
        configs = json.load(f)
    if not isinstance(configs, list) or not configs:
        raise ConfigError(f"{path}: expected a non-empty JSON list of configs")
    return configs


async def probe_configs(url: str, model_path: str, sender: str, tokens: list[int], configs: list[dict[str, Any]],
                        repeats: int, device: str = "cpu", dtype: str = "bfloat16") -> dict[str, Any]:
    """Per context length and config: TTFT (median of `repeats`, the first round dropped), every
    round's time, and the payload bytes the pull moved; a config that fails gets its error.
    `dtype`: the sender's (a pull lands in buffers of the receiver's dtype)."""
    import nats

    from droidmesh.shared.kv import scd
    from droidmesh.shared.transport import codecs

    model = load_model(model_path, dtype=dtype, device=device)
    if model.tokenizer is None:
        raise ConfigError(f"{model_path} has no tokenizer")
    for c in configs:
        if c.get("maps_file"):
            with open(c["maps_file"], "rb") as f:
                codecs.LOWRANK.add_maps(scd.Maps.from_bytes(f.read(), c["codec_params"][codecs.MAPS_PARAM]))
    nc = await nats.connect(url, **env_login())  # the login the harness gave this process, if any
    events: asyncio.Queue = asyncio.Queue()

    async def on_available(msg: Any) -> None:
        await events.put(schemas.decode(msg.data, schemas.CacheAvailable))

    await nc.subscribe(subjects.CACHE_AVAILABLE_ALL, cb=on_available)
    holders = [await _fresh_context(nc, events, sender, t) for t in tokens]
    L = model.num_layers
    loop = asyncio.get_running_loop()
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def run_torch(fn: Any, *args: Any) -> Any:
        return await loop.run_in_executor(torch_thread, functools.partial(fn, *args))

    question = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    bulk = make_client(holders[0].transport)
    out = []
    for ev in holders:
        await bulk.warm(ev.address)
        prompt = list(ev.token_ids) + question

        async def run(c: dict[str, Any], ev: schemas.CacheAvailable = ev, prompt: list[int] = prompt
                      ) -> tuple[float, int]:
            plan = plan_from_dict(c["plan"])
            t0 = time.perf_counter()
            if plan.mode == "full_prefill":
                await run_torch(functools.partial(generate, model, prompt, plan, max_new_tokens=1))
                return time.perf_counter() - t0, 0
            src = source_for(ev)

            async def pull() -> int:  # a single-use grant first, as a receiver's pull does
                try:
                    token = await request_grant(requester(nc), ev, 10)
                    return await pull_into(bulk, ev, pull_items(plan, L), model, src, timeout_s=300, token=token,
                                           codec=c["codec"], codec_params=c.get("codec_params") or {})
                except BaseException as e:  # the engine waiting on the source stops now, not at its timeout
                    src.fail(e)
                    raise

            pulling = loop.create_task(pull())
            try:
                steps = generate_steps(model, prompt, plan, src, max_new_tokens=1, timeout_s=300)
                await drive_engine(steps, src, run_torch, {})
                ttft = time.perf_counter() - t0
            finally:
                nbytes = await pulling  # a failed pull raises here, before the engine's timeout
            return ttft, nbytes

        times: dict[str, list[float]] = {c["name"]: [] for c in configs}
        nbytes: dict[str, int] = {}
        errors: dict[str, str] = {}
        for _ in range(repeats + 1):  # the first round warms caches and endpoints; dropped
            for c in configs:
                if c["name"] in errors:
                    continue
                try:
                    t, n = await run(c)
                except Exception as e:  # one config failing over the mesh must not lose the others
                    errors[c["name"]] = f"{type(e).__name__}: {e}"[:500]
                    continue
                times[c["name"]].append(t)
                nbytes[c["name"]] = n
        for c in configs:
            name = c["name"]
            ts = times[name][1:]
            out.append({"config": name, "target_tokens": len(ev.token_ids), "tokens": len(ev.token_ids),
                        "ttft_s": statistics.median(ts) if ts and name not in errors else None, "rounds_s": times[name],
                        "bytes_total": nbytes.get(name), "error": errors.get(name)})
    await bulk.close()
    await nc.close()
    torch_thread.shutdown()
    for r, t in zip(out, [t for t in tokens for _ in configs], strict=True):
        r["target_tokens"] = t
    return {"total_layers": L, "rows": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sender", required=True)
    ap.add_argument("--tokens", default="4096", help="context tokens (--configs: a comma list)")
    ap.add_argument("--group", default="0,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=os.environ.get(DEVICE_ENV, "cpu"))
    ap.add_argument("--configs", help="a JSON list of configs to time (the codecs probe, see the docstring)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--configs: the sender's dtype")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in str(a.tokens).split(",") if t.strip()]
    if a.configs:
        res = asyncio.run(probe_configs(a.nats, a.model, a.sender, tokens, load_probe_configs(a.configs), a.repeats,
                                        a.device, a.dtype))
        sys.stdout.write("PROBE " + json.dumps(res) + "\n")
        return
    if len(tokens) != 1:
        ap.error("--tokens takes one value without --configs")
    s, e = (int(x) for x in a.group.split(","))
    out = asyncio.run(probe(a.nats, a.model, a.sender, tokens[0], (s, e), a.repeats, a.device))
    sys.stdout.write("PROBE " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
