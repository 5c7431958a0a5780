"""`droidmesh bench load` (the requests workload): Poisson arrivals against 1..N receiver copies,
DroidMesh's own choice of path (`auto`) against full prefill.

Called by `shared/cli/bench.py` (the agents workload is `shared/apps/agents.py`'s). Per number of
copies it starts a mesh (nats-server, broker, one sender, the receiver copies under one model id),
prefills a few contexts on the sender and warms every copy on them, then per rate and mode sends
requests at exponential gaps for `seconds` and waits for them all. Blocks for the whole sweep;
every process is stopped after each mesh. TTFT is measured at the client: the reply's own
decode time is subtracted from its end-to-end time, so it includes queueing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from droidmesh.shared.bench.harness import THREADS, launched_env, mesh
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.wire.schemas import Mode


async def _load_rate(access: MeshAccess, receiver: str, contexts: list[str], rate: float, seconds: float, mode: Mode,
                     slo_s: float, seed: int) -> dict[str, Any]:
    from droidmesh.shared.mesh.client import MeshClient

    client = await MeshClient.connect(access.url, **access.options("client"))
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


def run_load(sender_path: str, receiver_path: str, group: tuple[int, int], tokens: int, rates: list[float],
             seconds: float, slo_s: float, copies: list[int], device: str = DEFAULT_DEVICE) -> list[dict[str, Any]]:
    """One row per (copies, rate, mode): TTFT / TBT / end-to-end p50 and p99, goodput (requests
    per second within `slo_s` TTFT) and the paths the replies took."""
    from droidmesh.shared.mesh.client import MeshClient
    from droidmesh.shared.zoo import vocab

    rng = np.random.default_rng(0)
    contexts = [" ".join(rng.choice(vocab.FILLER, tokens).tolist()) for _ in range(4)]
    rows = []
    for n in copies:
        with mesh(Roster.local(["load-sender"], ["load-receiver"])) as (access, procs):
            url = access.url
            procs.append(start_service("cache_broker", {}, url, env={**THREADS, **access.env_for("broker")}))
            # the receivers reuse it on a default group: a reader by setting
            procs.append(start_service("sender", {"model_path": sender_path, "model_id": "load-sender",
                                                  "sender_id": "load-sender", "readers": ["load-receiver"],
                                                  "dtype": "bfloat16", "e_layers": [group[0]]}, url,
                                       env={**launched_env(device), **access.env_for(sender_user("load-sender"))}))
            for k in range(n):
                procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "load-receiver",
                                                        "dtype": "bfloat16", "default_group": list(group)}, url,
                                           name=f"receiver{k}",
                                           env={**launched_env(device), **access.env_for(receiver_user("load-receiver"))}))

            async def prefill_all(access: MeshAccess = access) -> None:
                ops = await MeshClient.connect(access.url, **access.options("admin"))  # filling a store: an operator's
                client = await MeshClient.connect(access.url, **access.options("client"))
                try:
                    for c in contexts:
                        await ops.prefill("load-sender", c, timeout=300)
                    for c in contexts:  # once per receiver copy's endpoint warm-up and until the broker sees them
                        await client.ask("load-receiver", c, " who", max_new_tokens=1, timeout=300)
                finally:
                    await client.close()
                    await ops.close()

            asyncio.run(prefill_all())
            for rate in tqdm(rates, desc=f"load x{n}", unit="rate"):
                for mode in ("auto", "full_prefill"):
                    r = asyncio.run(_load_rate(access, "load-receiver", contexts, rate, seconds, mode, slo_s,
                                               seed=int(rate * 7)))
                    rows.append({"receivers": n, **r})
    return rows
