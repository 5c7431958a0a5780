"""`droidmesh bench control`: how fast the control plane makes a cache findable.

Called by `shared/tools/cli/bench/data_plane.py`. Starts a nats-server and a cache broker, then from
this process publishes `n` synthetic availability events (no sender, no tensors: the address is a
placeholder nobody pulls from) as the sender `bench` and polls the broker's lookup as a receiver
of model `bench` until each is indexed, each over its own connection as that role's user. Blocks for
the whole run; both processes are stopped on the way out. The broker is trusted to answer every
lookup within 5 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import THREADS, mesh

ROSTER = Roster.local(["bench"], ["bench"])


async def _control(access: MeshAccess, n: int) -> dict[str, Any]:
    import nats

    from droidmesh.shared.wire import schemas, subjects

    nc = await nats.connect(access.url, **access.options(sender_user("bench")))  # publishes the events
    asker = await nats.connect(access.url, **access.options(receiver_user("bench")))  # asks the broker
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
            reply = schemas.decode((await asker.request(subjects.BROKER_LOOKUP, lookup, timeout=5)).data,
                                   schemas.LookupReply)
            t2 = time.perf_counter()
            if reply.holder is not None and reply.holder.context_id == f"c{i}":
                visible.append(t2 - t0)
                rtt.append(t2 - t1)
                break
    await asker.close()
    await nc.close()
    ms = lambda xs, q: float(np.percentile(np.array(xs) * 1e3, q))  # noqa: E731
    return {"events": n, "event_to_index_p50_ms": ms(visible, 50), "event_to_index_p99_ms": ms(visible, 99),
            "lookup_rtt_p50_ms": ms(rtt, 50), "lookup_rtt_p99_ms": ms(rtt, 99)}


def run_control(n: int) -> dict[str, Any]:
    """Availability event -> visible in the broker's index, and the lookup round trip: p50 and
    p99 in milliseconds over `n` events."""
    with mesh(ROSTER) as (access, procs):
        procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **access.env_for("broker")}))
        return asyncio.run(_control(access, n))
