"""The main job: a real mesh (nats-server + broker + senders + receivers as processes) serving a
small workload over two zoo pairs, with TTFT and quality per path.

For each pair and each test row: the sender answers its own question over the context (which
captures and announces the context), then the receiver is asked the row's question three ways —
full prefill, full reuse of the sender's KV, and the profiled (or default) partial recompute.

The mesh runs as a deployment does: nats-server under the roster's users and permissions
(`start_secure_nats`, fresh passwords), every service and client logged in as its role. Senders
grant pulls to the receivers of their pairs: a published pair config declares a profiled pair,
the sender's `readers` setting a pair on a default group.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from droidmesh.shared.mesh.nats_auth import MeshAccess, receiver_user
from droidmesh.shared.model.device import DEFAULT_DEVICE, DEVICE_ENV
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.report import format_table
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS, connect_as, start_control_plane, start_sender
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.wire import schemas

PATHS: tuple[schemas.Mode, ...] = ("full_prefill", "full_reuse", "auto")
async def _workload(access: MeshAccess, pairs: list[Pair], rows: dict[str, list[dict[str, Any]]],
                    say: Callable[[str], None]) -> list[dict[str, Any]]:
    # A sender's generate fills its store: an operator's job. The questions are a client's.
    ops, client = await connect_as(access, "admin", "client")
    out = []
    try:
        for pair in pairs:
            spec = task_spec(pair.task)
            for i, row in enumerate(rows[pair.task]):
                await ops.sender_generate(pair.sender, row["context"], row["input"], max_new_tokens=spec.max_new_tokens)
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
        await ops.close()
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
        access = start_control_plane(pairs, models, profiles, log_dir, procs)
        say(f"nats-server on {access.url}: a user per role, fresh passwords, anonymous connections refused")
        default_group = (0, max(1, round(0.25 * num_layers)))
        for name in dict.fromkeys(p.sender for p in pairs):
            mine = [p for p in pairs if p.sender == name]
            starts = {profiles[p.id]["chosen"]["start"] for p in mine if p.id in profiles}
            say(f"starting sender {name}")
            procs.append(start_sender(access, models[name], name, sorted(starts | {default_group[0]}), log_dir, env,
                                      paired=[p.receiver for p in mine if p.id in profiles],
                                      readers=[p.receiver for p in mine if p.id not in profiles]))
        for pair in pairs:
            args: dict[str, object] = {"model_path": models[pair.receiver].path, "model_id": pair.receiver}
            if pair.id not in profiles:
                args["default_group"] = list(default_group)
            say(f"starting receiver {pair.receiver} ({'profiled' if 'default_group' not in args else 'default'} group)")
            procs.append(start_service("receiver", args, access.url, name=f"receiver-{pair.receiver}",
                                       env={**env, **access.env_for(receiver_user(pair.receiver))}, log_dir=log_dir))
        rows = {p.task: make_rows(p.task, "test", n_rows, shape) for p in pairs}
        say(f"workload: {n_rows} contexts per pair x {len(PATHS)} paths")
        records = asyncio.run(_workload(access, pairs, rows, say))
        (log_dir / "records.json").write_text(json.dumps(records, indent=1))
        return summarize(records)
    finally:
        for p in reversed(procs):
            p.stop()
        say("mesh stopped")


COLUMNS = ["pair", "task", "path", "plan", "requests", "ttft_p50_ms", "speedup", "quality", "MB_pulled"]


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
