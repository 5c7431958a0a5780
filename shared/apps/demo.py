"""The main job: a real mesh (nats-server + broker + senders + receivers as processes) serving a
small workload over two zoo pairs, with TTFT and quality per path.

For each pair and each test row: the sender answers its own question over the context (which
captures and announces the context), then the receiver is asked the row's question three ways —
full prefill, full reuse of the sender's KV, and the profiled (or default) partial recompute.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from droidmesh.shared.bench.output import format_table
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model.device import DEFAULT_DEVICE, DEVICE_ENV
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling.profile import recompute_config
from droidmesh.shared.service.launch import Proc, start_nats, start_service
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.wire import schemas
from droidmesh.shared.zoo.suite import SuiteShape, make_rows

PATHS: tuple[schemas.Mode, ...] = ("full_prefill", "full_reuse", "auto")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The local mesh's services run many to a host: none takes the health port an image sets for its one service.
NO_HEALTH_PORT = {"DM_METRICS_PORT": "-1"}


async def _workload(url: str, pairs: list[Pair], rows: dict[str, list[dict[str, Any]]], say: Callable[[str], None]
                    ) -> list[dict[str, Any]]:
    client = await MeshClient.connect(url)
    out = []
    try:
        for pair in pairs:
            spec = task_spec(pair.task)
            for i, row in enumerate(rows[pair.task]):
                await client.sender_generate(pair.sender, row["context"], row["input"], max_new_tokens=spec.max_new_tokens)
                for mode in PATHS:
                    r = await client.ask(pair.receiver, row["context"], row["input"], mode=mode,
                                         max_new_tokens=spec.max_new_tokens, timeout=120)
                    q = score_text(spec, r.text, row["answers"])
                    out.append({"pair": pair.id, "task": pair.task, "mode": mode,
                                "path": r.path, "plan": r.plan, "ttft_ms": r.ttft_ms, "quality": q,
                                "bytes_pulled": r.bytes_pulled, "fallback": r.fallback_reason})
                say(f"  {pair.id}: row {i + 1}/{len(rows[pair.task])} done")
    finally:
        await client.close()
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for pair in dict.fromkeys(r["pair"] for r in records):
        base = statistics.median(r["ttft_ms"] for r in records if r["pair"] == pair and r["mode"] == "full_prefill")
        for mode in PATHS:
            rs = [r for r in records if r["pair"] == pair and r["mode"] == mode]
            ttft = statistics.median(r["ttft_ms"] for r in rs)
            table.append({
                "pair": pair, "task": rs[0]["task"], "path": "/".join(sorted({r["path"] for r in rs})),
                "plan": "/".join(sorted({r["plan"] for r in rs})), "requests": len(rs),
                "ttft_p50_ms": round(ttft, 1), "speedup": round(base / ttft, 2),
                "quality": round(statistics.fmean(r["quality"] for r in rs), 3),
                "MB_pulled": round(statistics.fmean(r["bytes_pulled"] for r in rs) / 1e6, 2),
            })
    return table


def run_demo(pairs: list[Pair], models: dict[str, ModelRef], n_rows: int, profiles: dict[str, dict[str, Any]],
             shape: SuiteShape, num_layers: int, say: Callable[[str], None], log_dir: Path | None = None,
             device: str = DEFAULT_DEVICE, dtype: str | None = None) -> list[dict[str, Any]]:
    """Start the mesh (every service's model on `device`, in `dtype` or the device's default),
    run the workload, stop everything; return the summary rows. `models`: model id ->
    checkpoint; `profiles`: pair id -> a saved `droidmesh profile` result (pairs without one get
    a default group)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="droidmesh-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**THREADS, **NO_HEALTH_PORT, DEVICE_ENV: device, **({"DM_DTYPE": dtype} if dtype else {})}
    procs: list[Proc] = []
    try:
        say(f"starting nats-server (logs in {log_dir})")
        url = start_control_plane(pairs, models, profiles, log_dir, procs)
        default_group = (0, max(1, round(0.25 * num_layers)))
        for name in dict.fromkeys(p.sender for p in pairs):
            starts = {profiles[p.id]["chosen"]["start"] for p in pairs if p.sender == name and p.id in profiles}
            say(f"starting sender {name}")
            procs.append(start_service("sender", {"model_path": models[name].path, "model_id": name,
                                                  "e_layers": sorted(starts | {default_group[0]})},
                                       url, name=f"sender-{name}", env=env, log_dir=log_dir))
        for pair in pairs:
            args: dict[str, object] = {"model_path": models[pair.receiver].path, "model_id": pair.receiver}
            if pair.id not in profiles:
                args["default_group"] = list(default_group)
            say(f"starting receiver {pair.receiver} ({'profiled' if 'default_group' not in args else 'default'} group)")
            procs.append(start_service("receiver", args, url, name=f"receiver-{pair.receiver}", env=env,
                                       log_dir=log_dir))
        rows = {p.task: make_rows(p.task, "test", n_rows, shape) for p in pairs}
        say(f"workload: {n_rows} contexts per pair x {len(PATHS)} paths")
        records = asyncio.run(_workload(url, pairs, rows, say))
        (log_dir / "records.json").write_text(json.dumps(records, indent=1))
        return summarize(records)
    finally:
        for p in reversed(procs):
            p.stop()
        say("mesh stopped")


def start_control_plane(pairs: Sequence[Pair], models: dict[str, ModelRef], profiles: dict[str, dict[str, Any]],
                        log_dir: Path, procs: list[Proc], relay: Sequence[schemas.RelayBucket] = ()) -> str:
    """nats-server, the pairs' saved profiles published as configs (with the relay audit's
    `relay` buckets), a broker (each appended to `procs`, logs in `log_dir`); the NATS url."""
    nats, url = start_nats(log_dir=log_dir)
    procs.append(nats)
    configs = [msgspec.structs.replace(recompute_config(profiles[p.id], models[p.sender], models[p.receiver], 1),
                                       relay=list(relay)) for p in pairs if p.id in profiles]
    asyncio.run(publish_configs(configs, url))
    procs.append(start_service("cache_broker", {}, url, env={**THREADS, **NO_HEALTH_PORT}, log_dir=log_dir))
    return url


async def publish_configs(configs: list[schemas.RecomputeConfig], url: str) -> None:
    if not configs:
        return
    client = await MeshClient.connect(url)
    try:
        board = client.bus.config_board()
        for cfg in configs:
            await board.put(cfg)
    finally:
        await client.close()


COLUMNS = ["pair", "task", "path", "plan", "requests", "ttft_p50_ms", "speedup", "quality", "MB_pulled"]


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
