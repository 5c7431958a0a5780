"""The cache broker under an in-cap event flood from one sender login (`python -m droidmesh.shared.tools.bench.broker_flood`).

Starts a nats-server with per-role users (`shared/mesh/nats_auth.py`) and a cache broker, then from
this process plays three peers, each under its own login:
  - an honest sender (`sender-honest`): announces one context, heart-beats listing it, and
    re-announces it when the broker says hello (what a real sender does, without a model);
  - a flooding sender (`sender-flood`): availability events that are each within every cap the
    broker enforces (well-formed, its own id, at most `max_contexts_per_sender` context ids, at most
    `max_context_tokens` tokens), published at a fixed rate for a bounded time and count;
  - a receiver (`receiver-m`): honest lookups of the honest context at a fixed pace, each with a
    deadline.
It reports the broker's RSS (psutil) before, at peak and after, the share of honest lookups answered
with the honest holder within their deadline, whether the honest sender was ever expired, and how
long after the flood the honest context is found again. The broker runs whatever code is installed,
so the same run measures any version of it. Used by `tests/system/test_broker_flood.py` too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, render, sender_user
from droidmesh.shared.service.launch import Proc, start_nats, start_service
from droidmesh.shared.service.localmesh import THREADS
from droidmesh.shared.wire import schemas, subjects

HONEST, FLOOD, MODEL = "honest", "flood", "m"
ROSTER = Roster(senders=((HONEST, MODEL), (FLOOD, MODEL)), receivers=(MODEL,))
FP = schemas.Fingerprint("llama", 12, 128, 4, 4, 32, "{}", "flood-bench")
FP_ID = "flood-bench"
HONEST_TOKENS = list(range(100, 100 + 512))  # below the flood's ids: never a prefix of a flooded context


@dataclass(frozen=True)
class Flood:
    """One flood: `rate` events a second for at most `seconds` and `events`, each of `tokens` token
    ids, cycling over `contexts` context ids (re-announcing one it announced before costs the
    broker the same work again, without a new context)."""

    seconds: float = 30.0
    events: int = 3000
    rate: float = 40.0
    tokens: int = 1 << 18
    contexts: int = 48


@dataclass
class Figures:
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    flood_events: int = 0
    flood_mb: float = 0.0
    lookups: int = 0
    lookups_answered: int = 0  # answered within the deadline with the honest holder
    honest_expired: int = 0  # times the broker dropped the honest sender for missing heartbeats
    recovered_after_s: float | None = None  # after the flood, until the honest context is found again
    index_bytes: float | None = None  # the broker's own count (dm_index_bytes), when it exports one
    over_budget: dict[str, float] = field(default_factory=dict)  # dm_broker_over_budget_total by reason

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["lookup_success"] = round(self.lookups_answered / self.lookups, 3) if self.lookups else None
        return d


@contextmanager
def secured_nats(tmp: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A nats-server with ROSTER's users: (url, password by user)."""
    passwords = {u: secrets.token_hex(12) for u in ROSTER.users}
    conf = tmp / "nats-auth.conf"
    conf.write_text(render(ROSTER))
    proc, url = start_nats(store_dir=str(tmp / "js"), conf=conf, env={password_env(u): p for u, p in passwords.items()})
    try:
        yield url, passwords
    finally:
        proc.stop()


def start_broker(url: str, passwords: dict[str, str], args: dict[str, object], env: dict[str, str] | None = None) -> Proc:
    """A broker process under the broker user, its health port on a free port (logged). Settings
    in `env` (DM_CACHE_BROKER_*) rather than `args` are ignored by a broker that lacks them."""
    env = {**THREADS, "DM_NATS_USER": "broker", "DM_NATS_PASSWORD": passwords["broker"], **(env or {})}
    return start_service("cache_broker", {"metrics_port": 0, **args}, url, env=env)


def metric(port: int, name: str) -> dict[str, float]:
    """Samples of one metric on a health port, by their label text ("" for an unlabelled one)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key[len(name):].strip("{}")] = float(value)
    return out


async def connect(url: str, user: str, passwords: dict[str, str]) -> Any:
    import nats

    return await nats.connect(url, user=user, password=passwords[user], inbox_prefix=subjects.inbox_prefix(user),
                              max_reconnect_attempts=0)


def _available(sender: str, cid: str, tokens: list[int]) -> bytes:
    return schemas.encode(schemas.CacheAvailable(
        sender_id=sender, model_id=MODEL, model_sha256="bench", fingerprint=FP, fingerprint_id=FP_ID, context_id=cid,
        token_ids=tokens, dtype="bfloat16", kv_nbytes=[1] * 12, e_layers=[0], e_nbytes=1, transport="ucx",
        address="127.0.0.1:1", published_at=time.time()))


class HonestSender:
    """Announces its one context, heart-beats every `interval_s` listing it, re-announces on hello."""

    def __init__(self, nc: Any, interval_s: float):
        self.nc, self.interval_s = nc, interval_s
        self.event = _available(HONEST, "honest-ctx", HONEST_TOKENS)

    async def run(self, stop: asyncio.Event) -> None:
        async def on_hello(msg: Any) -> None:
            hello = schemas.decode(msg.data, schemas.BrokerHello)
            if hello.sender_id in ("", HONEST):
                await self.nc.publish(subjects.cache_available(HONEST), self.event)

        await self.nc.subscribe(subjects.BROKER_HELLO, cb=on_hello)
        await self.nc.publish(subjects.cache_available(HONEST), self.event)
        while not stop.is_set():
            hb = schemas.SenderHeartbeat(sender_id=HONEST, model_id=MODEL, context_ids=["honest-ctx"],
                                         interval_s=self.interval_s, sent_at=time.time())
            await self.nc.publish(subjects.sender_heartbeat(HONEST), schemas.encode(hb))
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass


async def honest_lookup(nc: Any, deadline_s: float) -> bool:
    """One lookup of the honest context: True when answered within `deadline_s` naming the honest holder."""
    import nats.errors

    req = schemas.encode(schemas.LookupRequest(token_ids=HONEST_TOKENS + [7, 7], fingerprint_id=FP_ID))
    try:
        reply = await nc.request(subjects.BROKER_LOOKUP, req, timeout=deadline_s)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    holder = schemas.decode(reply.data, schemas.LookupReply).holder
    return holder is not None and holder.sender_id == HONEST


async def until_found(nc: Any, timeout_s: float, deadline_s: float = 2.0) -> float | None:
    """Seconds until an honest lookup finds the honest context (None: not within `timeout_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await honest_lookup(nc, deadline_s):
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    return None


async def flood(nc: Any, spec: Flood, seed: int = 0) -> tuple[int, int]:
    """Publish `spec`'s events as sender-flood; (events, bytes) published. The payloads are
    encoded up front (distinct random token ids per context, all above HONEST_TOKENS)."""
    rng = np.random.default_rng(seed)
    payloads = [_available(FLOOD, f"flood-{i}", rng.integers(1000, 60_000, spec.tokens).tolist())
                for i in range(spec.contexts)]
    sent = nbytes = 0
    t0 = time.monotonic()
    while sent < spec.events and (now := time.monotonic() - t0) < spec.seconds:
        ahead = sent / spec.rate - now
        if ahead > 0:
            await asyncio.sleep(ahead)
        data = payloads[sent % len(payloads)]
        await nc.publish(subjects.cache_available(FLOOD), data)
        sent, nbytes = sent + 1, nbytes + len(data)
        if sent % 16 == 0:
            await nc.flush(timeout=30)  # keep this client's buffer bounded: the flood is paced, not queued here
    await nc.flush(timeout=30)
    return sent, nbytes


class RssSampler:
    """Peak RSS of a process, sampled every `every_s` from a thread until stopped."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.proc, self.every_s, self.peak = psutil.Process(pid), every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss")

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.peak = max(self.peak, self.now())
            except psutil.Error:
                return

    def __enter__(self) -> RssSampler:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


async def run_against(url: str, passwords: dict[str, str], broker: Proc, spec: Flood, heartbeat_s: float = 1.0,
                      lookup_every_s: float = 0.25, lookup_deadline_s: float = 1.0, recover_s: float = 60.0) -> Figures:
    """The honest sender, the flood and the honest lookups against a running `broker`."""
    figs = Figures()
    honest_nc, flood_nc, recv_nc = [await connect(url, u, passwords)
                                    for u in (sender_user(HONEST), sender_user(FLOOD), receiver_user(MODEL))]
    stop = asyncio.Event()
    honest = asyncio.create_task(HonestSender(honest_nc, heartbeat_s).run(stop))
    try:
        if await until_found(recv_nc, 30) is None:
            raise RuntimeError("the broker never indexed the honest context:\n" + broker.tail())
        mb = 1 << 20
        with RssSampler(broker.popen.pid) as rss:
            figs.rss_before_mb = rss.now() / mb
            flooding = asyncio.create_task(flood(flood_nc, spec))
            while not flooding.done():
                t = time.monotonic()
                figs.lookups += 1
                figs.lookups_answered += await honest_lookup(recv_nc, lookup_deadline_s)
                await asyncio.sleep(max(0.0, lookup_every_s - (time.monotonic() - t)))
            figs.flood_events, nbytes = await flooding
            figs.flood_mb = nbytes / mb
            figs.recovered_after_s = await until_found(recv_nc, recover_s)
            figs.rss_peak_mb, figs.rss_after_mb = rss.peak / mb, rss.now() / mb
    finally:
        stop.set()
        await honest
        for nc in (honest_nc, flood_nc, recv_nc):
            await nc.close()
    figs.honest_expired = sum(e.get("sender_id") == HONEST for e in broker.events("sender_expired"))
    port = broker.events("health_listening")[0]["port"]
    figs.index_bytes = metric(port, "dm_index_bytes").get("")
    figs.over_budget = {k: v for k, v in metric(port, "dm_broker_over_budget_total").items()}
    return figs


def run_flood(spec: Flood, broker_args: dict[str, object] | None = None, **kw: Any) -> dict[str, Any]:
    """Start nats-server and a broker, run the flood against them, stop both; the figures."""
    with tempfile.TemporaryDirectory(prefix="dm-flood-") as tmp, secured_nats(Path(tmp)) as (url, passwords):
        broker = start_broker(url, passwords, broker_args or {})
        try:
            figs = asyncio.run(run_against(url, passwords, broker, spec, **kw))
        finally:
            broker.stop()
    return {"flood": spec.__dict__, **figs.as_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=Flood.seconds)
    p.add_argument("--events", type=int, default=Flood.events)
    p.add_argument("--rate", type=float, default=Flood.rate, help="flood events a second")
    p.add_argument("--tokens", type=int, default=Flood.tokens, help="token ids per flood event")
    p.add_argument("--contexts", type=int, default=Flood.contexts, help="distinct context ids the flood cycles over")
    p.add_argument("--broker-arg", action="append", default=[], metavar="K=V", help="a broker flag, e.g. ttl_factor=3")
    a = p.parse_args()
    args = dict(kv.split("=", 1) for kv in a.broker_arg)
    print(json.dumps(run_flood(Flood(a.seconds, a.events, a.rate, a.tokens, a.contexts), args), indent=1))


if __name__ == "__main__":
    main()
