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

With `--configs FILE` it is the configs probe (`droidmesh bench codecs`, `bench_mesh`'s mesh check,
`probe_configs`): for each context length in `--tokens` (a comma list) one fresh context, then
every listed config (a plan, patch layers included, a wire codec and its params, the maps file a
lowrank config needs, and a mode: pipelined through the mesh, local, or the pull alone; see
`_run_config`) is timed on that same context, median of repeats, the first round dropped.
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
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.kv.partial import generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.mesh.nats_auth import env_login
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.model.device import DEVICE_ENV
from droidmesh.shared.service.engine import drive_engine
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.transport.pull import pull_into, pull_items, request_grant, requester, source_for
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.schemas import PullItem

QUESTION = " who"


class _Session:
    """What a probe holds on its event loop: the model, its NATS connection (logged in as the
    harness says) with the availability events, and the one torch thread the pipelined engine's
    steps run on, as in a receiver."""

    def __init__(self, model: ModelAdapter, nc: Any, events: asyncio.Queue) -> None:
        self.model, self.nc, self.events = model, nc, events
        self.loop = asyncio.get_running_loop()
        self.torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    @classmethod
    async def open(cls, url: str, model: ModelAdapter) -> _Session:
        import nats

        nc = await nats.connect(url, **env_login())  # the login the harness gave this process, if any
        events: asyncio.Queue = asyncio.Queue()

        async def on_available(msg: Any) -> None:
            await events.put(schemas.decode(msg.data, schemas.CacheAvailable))

        await nc.subscribe(subjects.CACHE_AVAILABLE_ALL, cb=on_available)
        return cls(model, nc, events)

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        return await self.loop.run_in_executor(self.torch_thread, functools.partial(fn, *args))

    async def pull(self, bulk: Any, ev: schemas.CacheAvailable, items: list[PullItem], src: ArrivingSource | None,
                   **codec: Any) -> int:
        """Pull `items` of `ev` into `src` (None: discarded); one single-use grant per pull, as a receiver does."""
        token = await request_grant(requester(self.nc), ev, 10)
        return await pull_into(bulk, ev, items, self.model, src, timeout_s=300, token=token, **codec)

    async def close(self, bulk: Any) -> None:
        await bulk.close()
        await self.nc.close()
        self.torch_thread.shutdown()


class _Modes:
    """The pipeline probe's modes (the module docstring's table) over one held context."""

    NAMES = ("transfer", "recompute", "all", "reused", "piped", "prefill")

    def __init__(self, s: _Session, ev: schemas.CacheAvailable, bulk: Any, prompt: list[int], plan: ReusePlan) -> None:
        self.s, self.ev, self.bulk, self.prompt, self.plan = s, ev, bulk, prompt, plan
        L = s.model.num_layers
        self.needed = pull_items(plan, L)  # E first (none for a group at layer 0: own embeddings), then reused KV
        self.every = [PullItem(layer=l, kind="E") for l in plan.e_layers] + [
            PullItem(layer=l, kind=k) for l in range(L) for k in ("K", "V")]

    def engine(self, src: ArrivingSource) -> float:
        t0 = time.perf_counter()
        generate(self.s.model, self.prompt, self.plan, src, max_new_tokens=1, timeout_s=300)
        return time.perf_counter() - t0

    async def run(self, mode: str) -> float:
        s, loop, model, prompt = self.s, self.s.loop, self.s.model, self.prompt
        src = source_for(self.ev)
        t0 = time.perf_counter()
        if mode == "transfer":
            await s.pull(self.bulk, self.ev, self.needed, None)
        elif mode == "recompute":
            await s.pull(self.bulk, self.ev, self.needed, src)
            return await loop.run_in_executor(None, self.engine, src)
        elif mode in ("all", "reused"):
            await s.pull(self.bulk, self.ev, self.every if mode == "all" else self.needed, src)
            await loop.run_in_executor(None, self.engine, src)
        elif mode == "piped":
            pulling = loop.create_task(s.pull(self.bulk, self.ev, self.needed, src))
            steps = generate_steps(model, prompt, self.plan, src, max_new_tokens=1, timeout_s=300)
            await drive_engine(steps, src, s.run_torch, {})
            await pulling
        else:  # prefill
            await loop.run_in_executor(None, lambda: generate(model, prompt, ReusePlan.full_prefill(), max_new_tokens=1))
        return time.perf_counter() - t0


async def probe(url: str, model_path: str, sender: str, tokens: int, group: tuple[int, int], repeats: int,
                device: str = "cpu") -> dict[str, Any]:
    model = load_model(model_path, dtype="bfloat16", device=device)
    s = await _Session.open(url, model)
    # A fresh context per probe: a sender announces a context once, when it first captures it.
    ev = await _fresh_context(s.nc, s.events, sender, tokens, request_id="probe")
    if model.tokenizer is None:
        raise ConfigError(f"{model_path} has no tokenizer")
    prompt = list(ev.token_ids) + model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    L = model.num_layers
    plan = ReusePlan.recompute(*group)
    bulk = make_client(ev.transport)
    await bulk.warm(ev.address)
    modes = _Modes(s, ev, bulk, prompt, plan)
    times: dict[str, list[float]] = {m: [] for m in modes.NAMES}
    for _ in range(repeats + 1):  # the first round warms caches and endpoints; dropped
        for m in modes.NAMES:
            times[m].append(await modes.run(m))
    await s.close(bulk)
    med = {m: statistics.median(v[1:]) for m, v in times.items()}
    reused_bytes = sum(ev.kv_nbytes[l] for l in plan.reused_layers(L)) + ev.e_nbytes
    return {"context_tokens": len(ev.token_ids), "group": list(group), "total_layers": L, "seconds": med,
            "reused_bytes": reused_bytes, "all_bytes": sum(ev.kv_nbytes) + ev.e_nbytes,
            "achieved_gbit_s": reused_bytes * 8 / med["transfer"] / 1e9,
            "pipeline_overhead": med["piped"] / max(med["recompute"], med["transfer"])}


async def _fresh_context(nc: Any, events: asyncio.Queue, sender: str, tokens: int,
                         request_id: str | None = None) -> schemas.CacheAvailable:
    """Have `sender` prefill a fresh filler context of about `tokens` tokens; its availability event."""
    from droidmesh.shared.tasks import vocab

    rng = __import__("random").Random(time.time_ns())
    context = " ".join(rng.choice(vocab.FILLER) for _ in range(tokens))
    reply = await nc.request(subjects.sender_prefill(sender), schemas.encode(
        schemas.PrefillRequest(request_id=request_id or f"probe-{tokens}", context=context)), timeout=300)
    try:
        schemas.decode(reply.data, schemas.PrefillReply)
    except DroidMeshError:  # the sender's error, said now, not as a missing event a minute later
        error = schemas.decode(reply.data, schemas.ErrorReply)
        raise RuntimeError(f"{sender} refused the prefill: {error.code}: {error.message}") from None
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
    model = load_model(model_path, dtype=dtype, device=device)
    if model.tokenizer is None:
        raise ConfigError(f"{model_path} has no tokenizer")
    _add_maps(configs)
    s = await _Session.open(url, model)
    holders = [await _fresh_context(s.nc, s.events, sender, t) for t in tokens]
    question = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    bulk = make_client(holders[0].transport)
    out = []
    for ev in holders:
        await bulk.warm(ev.address)
        prompt = list(ev.token_ids) + question
        times, nbytes, errors = await _time_configs(functools.partial(_run_config, s, bulk, ev, prompt), configs,
                                                    repeats)
        for c in configs:
            name = c["name"]
            ts = times[name][1:]
            out.append({"config": name, "target_tokens": len(ev.token_ids), "tokens": len(ev.token_ids),
                        "ttft_s": statistics.median(ts) if ts and name not in errors else None, "rounds_s": times[name],
                        "bytes_total": nbytes.get(name), "error": errors.get(name)})
    await s.close(bulk)
    for r, t in zip(out, [t for t in tokens for _ in configs], strict=True):
        r["target_tokens"] = t
    return {"total_layers": model.num_layers, "rows": out}


def _add_maps(configs: list[dict[str, Any]]) -> None:
    """Register the SCD maps of the lowrank configs with the codec (what their pulls decode with)."""
    from droidmesh.shared.kv import scd
    from droidmesh.shared.transport import codecs

    for c in configs:
        if c.get("maps_file"):
            with open(c["maps_file"], "rb") as f:
                codecs.LOWRANK.add_maps(scd.Maps.from_bytes(f.read(), c["codec_params"][codecs.MAPS_PARAM]))


async def _run_config(s: _Session, bulk: Any, ev: schemas.CacheAvailable, prompt: list[int], c: dict[str, Any]
                      ) -> tuple[float, int]:
    """One round of config `c` over `ev`'s context: (seconds, payload bytes pulled). The seconds
    by the config's `mode`: "mesh" (default) to the first token, the pull streaming in while the
    engine runs; "local" the engine alone to the first token, every tensor pulled beforehand (the
    sender's cache already in memory); "transfer" the pull alone."""
    plan = plan_from_dict(c["plan"])
    mode = c.get("mode", "mesh")
    t0 = time.perf_counter()
    if plan.mode == "full_prefill":
        await s.run_torch(functools.partial(generate, s.model, prompt, plan, max_new_tokens=1))
        return time.perf_counter() - t0, 0
    src = source_for(ev)
    if mode in ("local", "transfer"):
        nbytes = await s.pull(bulk, ev, pull_items(plan, s.model.num_layers), src, codec=c["codec"],
                              codec_params=c.get("codec_params") or {})
        if mode == "transfer":
            return time.perf_counter() - t0, nbytes
        t0 = time.perf_counter()
        await s.run_torch(functools.partial(generate, s.model, prompt, plan, src, max_new_tokens=1, timeout_s=300))
        return time.perf_counter() - t0, nbytes

    async def pull() -> int:
        try:
            return await s.pull(bulk, ev, pull_items(plan, s.model.num_layers), src, codec=c["codec"],
                                codec_params=c.get("codec_params") or {})
        except BaseException as e:  # the engine waiting on the source stops now, not at its timeout
            src.fail(e)
            raise

    pulling = s.loop.create_task(pull())
    try:
        steps = generate_steps(s.model, prompt, plan, src, max_new_tokens=1, timeout_s=300)
        await drive_engine(steps, src, s.run_torch, {})
        ttft = time.perf_counter() - t0
    finally:
        nbytes = await pulling  # a failed pull raises here, before the engine's timeout
    return ttft, nbytes


async def _time_configs(run: Callable[[dict[str, Any]], Awaitable[tuple[float, int]]], configs: list[dict[str, Any]],
                        repeats: int) -> tuple[dict[str, list[float]], dict[str, int], dict[str, str]]:
    """(every round's seconds, payload bytes, error) per config name, `repeats` + 1 rounds each."""
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
    return times, nbytes, errors


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
