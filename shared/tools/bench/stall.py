"""`droidmesh bench stall`: what a frozen sender costs the requests that do not use it.

On the demo tier's first pair, on a mesh started here (nats-server, broker, senders `a` and `b`
holding the sender's weights under two model ids, one receiver whose reuse timeout outlasts the
measurement; every process on `transport`, logs in `log_dir`):
  1. each sender prefills a context of its own; one request per context is repeated until it is
     reused (path `partial`), so both are indexed and both connections are warm;
  2. baseline: `n` requests over a's context, one at a time; their TTFT from the replies;
  3. stall: SIGSTOP b, send `k` requests over b's context (each waits on b: its grant or its pull),
     then the same `n` requests over a's context, one at a time, while those wait;
  4. SIGCONT b; the stalled requests are answered (reused once b resumes, or their own prefill
     after the timeout) and kept with their paths.
Result: per phase the TTFT p50 of a's requests and `stall_ratio` = stalled / baseline (target
<= 1.10); the paths of b's requests, which must all be answered.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.service.launch import Proc, start_secure_nats, start_service
from droidmesh.shared.service.localmesh import THREADS, connect_as
from droidmesh.shared.wire import schemas

WARM_TRIES = 50  # requests per context before it must have been reused
COLUMNS = ["phase", "requests", "ttft_p50_ms", "ttft_max_ms", "paths"]


def context(seed: int, words: int) -> str:
    """A deterministic context of `words` words (every sender and run prefills the same text)."""
    rng = np.random.default_rng(seed)
    vocab = ["river", "stone", "lamp", "harbor", "winter", "copper", "garden", "signal", "orbit", "meadow", "ledger",
             "canvas", "thunder", "violet", "anchor", "marble", "falcon", "timber", "beacon", "saddle"]
    return " ".join(f"{vocab[i]}{j}" for i, j in zip(rng.integers(0, len(vocab), words), rng.integers(0, 50, words),
                                                      strict=True))


async def _warm(client: MeshClient, text: str) -> None:
    """Ask over `text` until the receiver reuses it (indexed, connected); raise if it never does."""
    for i in range(WARM_TRIES):
        reply = await client.ask("bench-receiver", text, f" warm {i}", max_new_tokens=1, timeout=120)
        if reply.path == "partial":
            return
    raise RuntimeError(f"no reuse after {WARM_TRIES} requests (is the context indexed?)")


async def _series(client: MeshClient, text: str, n: int, tag: str) -> list[schemas.GenerateReply]:
    return [await client.ask("bench-receiver", text, f" {tag} question {i}", max_new_tokens=1, timeout=120)
            for i in range(n)]


async def _run(access: MeshAccess, b: Proc, n: int, k: int, words: int
               ) -> tuple[dict[str, list[schemas.GenerateReply]], int]:
    """The replies per phase, and how many stalled requests were still waiting when a's series ended."""
    ctx_a, ctx_b = context(1, words), context(2, words)
    ops, client = await connect_as(access, "admin", "client")  # prefills are an operator's, questions a client's
    try:
        await ops.prefill("stall-a", ctx_a, timeout=120)
        await ops.prefill("stall-b", ctx_b, timeout=120)
        await _warm(client, ctx_a)
        await _warm(client, ctx_b)
        baseline = await _series(client, ctx_a, n, "baseline")
        b.popen.send_signal(signal.SIGSTOP)
        stalled = [asyncio.create_task(client.ask("bench-receiver", ctx_b, f" stalled {i}", max_new_tokens=1,
                                                  timeout=300)) for i in range(k)]
        try:
            during = await _series(client, ctx_a, n, "during")
            waiting = sum(not t.done() for t in stalled)
        except BaseException:
            for t in stalled:
                t.cancel()
            raise
        finally:
            b.popen.send_signal(signal.SIGCONT)
            await asyncio.gather(*stalled, return_exceptions=True)
        # every stalled request must have been answered: a lost one raises here
        return {"baseline": baseline, "during_stall": during, "stalled": [t.result() for t in stalled]}, waiting
    finally:
        await client.close()
        await ops.close()


def _row(phase: str, replies: list[schemas.GenerateReply]) -> dict[str, Any]:
    ttft = [r.ttft_ms for r in replies]
    paths = sorted({r.path for r in replies})
    return {"phase": phase, "requests": len(replies), "ttft_p50_ms": statistics.median(ttft), "ttft_max_ms": max(ttft),
            "paths": ",".join(paths)}


def run_stall(sender_path: str, receiver_path: str, group: tuple[int, int], log_dir: Path, *, transport: str = "ucx",
              n: int = 9, k: int = 2, words: int = 500, timeout_s: float = 60.0) -> dict[str, Any]:
    """Start the mesh, run the sequence of the module docstring, stop it; the summary."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        roster = Roster(senders=(("a", "stall-a"), ("b", "stall-b")), receivers=("bench-receiver",))
        nats, access = start_secure_nats(roster, log_dir=log_dir)
        procs.append(nats)
        url = access.url
        procs.append(start_service("cache_broker", {}, url, env={**THREADS, **access.env_for("broker")},
                                   log_dir=log_dir))
        senders = {}
        for sid in ("a", "b"):  # the receiver reuses them on a default group: readers by setting
            senders[sid] = start_service("sender", {"model_path": sender_path, "model_id": f"stall-{sid}", "sender_id": sid,
                                                    "e_layers": [group[0]], "transport": transport,
                                                    "readers": ["bench-receiver"]}, url,
                                         name=f"sender-{sid}", env={**THREADS, **access.env_for(sender_user(sid))},
                                         log_dir=log_dir)
            procs.append(senders[sid])
        procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "bench-receiver",
                                                "default_group": list(group), "reuse_timeout_s": timeout_s,
                                                "breaker_failures": 1000, "transport": transport}, url,
                                   env={**THREADS, **access.env_for(receiver_user("bench-receiver"))}, log_dir=log_dir))
        got, waiting = asyncio.run(_run(access, senders["b"], n, k, words))
    finally:
        for p in reversed(procs):
            p.stop()
    rows = [_row(phase, got[phase]) for phase in ("baseline", "during_stall", "stalled")]
    base, during = rows[0]["ttft_p50_ms"], rows[1]["ttft_p50_ms"]
    return {"rows": rows, "stall_ratio": during / base, "transport": transport, "group": list(group), "words": words,
            "stalled_requests": k, "still_waiting_after_series": waiting, "reuse_timeout_s": timeout_s,
            "log_dir": str(log_dir)}
