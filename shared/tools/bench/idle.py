"""`droidmesh bench idle`: what each service costs while nothing is asked of it.

On the demo tier's first pair, a mesh started here (nats-server, broker, one sender, one
receiver, the gateway on loopback; every process on `transport`): one context is prefilled and
asked over until the receiver reuses it, so the bulk connection between the two is open (an
idle UCX server used to spin from the first pull on), then nothing happens for `idle_s` seconds.
Per process: the CPU seconds (user + system, every thread) it used over that window, and that
as a share of one core (target: <= 0.01 each).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import psutil

from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import THREADS, connect_as, mesh
from droidmesh.shared.tools.bench.stall import WARM_TRIES, context

COLUMNS = ["process", "cpu_s", "core_share", "meets_target"]
TARGET = 0.01  # of one core


async def _warm(access: MeshAccess, words: int) -> str:
    """Prefill a context and ask until it is reused; the path of the last reply."""
    ops, client = await connect_as(access, "admin", "client")
    try:
        text = context(3, words)
        await ops.prefill("idle", text, timeout=120)
        for i in range(WARM_TRIES):
            reply = await client.ask("bench-receiver", text, f" warm {i}", max_new_tokens=1, timeout=120)
            if reply.path == "partial":
                return reply.path
        raise RuntimeError(f"no reuse after {WARM_TRIES} requests (is the context indexed?)")
    finally:
        await client.close()
        await ops.close()


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_idle(sender_path: str, receiver_path: str, group: tuple[int, int], log_dir: Path, *,
             transport: str = "ucx", idle_s: float = 60.0, words: int = 200) -> dict[str, Any]:
    """Start the mesh, warm the connection, measure `idle_s` of idling, stop it; the rows."""
    log_dir.mkdir(parents=True, exist_ok=True)
    roster = Roster(senders=(("idle-sender", "idle"),), receivers=("bench-receiver",))
    with mesh(roster) as (access, procs):  # every process stopped on the way out
        url = access.url
        procs.append(start_service("cache_broker", {}, url, env={**THREADS, **access.env_for("broker")},
                                   log_dir=log_dir))
        procs.append(start_service("sender", {"model_path": sender_path, "model_id": "idle", "sender_id": "idle-sender",
                                              "e_layers": [group[0]], "transport": transport,
                                              "readers": ["bench-receiver"]}, url,
                                   env={**THREADS, **access.env_for(sender_user("idle-sender"))}, log_dir=log_dir))
        procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "bench-receiver",
                                                "default_group": list(group), "transport": transport}, url,
                                   env={**THREADS, **access.env_for(receiver_user("bench-receiver"))}, log_dir=log_dir))
        procs.append(start_service("gateway", {"http_port": 0, "metrics_port": 0}, url,
                                   env={**THREADS, **access.env_for("gateway")}, log_dir=log_dir))
        path = asyncio.run(_warm(access, words))
        watched = {p.name: psutil.Process(p.popen.pid) for p in procs}
        before = {name: _cpu_s(p) for name, p in watched.items()}
        t0 = time.monotonic()
        time.sleep(idle_s)
        window = time.monotonic() - t0
        used = {name: _cpu_s(p) - before[name] for name, p in watched.items()}
    rows = [{"process": name, "cpu_s": round(s, 3), "core_share": round(s / window, 4), "meets_target": s / window <= TARGET}
            for name, s in used.items()]
    return {"rows": rows, "idle_s": window, "transport": transport, "warm_path": path, "target_core_share": TARGET,
            "log_dir": str(log_dir)}
