"""Hostile control messages (huge and negative numbers, NaN, long strings, huge lists) against the
broker's handlers and index and the receivers' / senders' config handling, in process: nothing
raises, nothing grows past its cap, nothing stays alive forever, hostile configs are ignored."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from droidmesh.services.cache_broker import handlers as broker
from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.index import CacheIndex, Limits
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.services.receiver import handlers as receiver
from droidmesh.services.sender import handlers as sender
from droidmesh.shared.alarms import alarms
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.config_board import InMemoryConfigBoard
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas, subjects
from tests.unit.test_runtime import until

pytestmark = pytest.mark.fuzz

HOSTILE_INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([-1, 0, 2**31, 2**32, 2**63 - 1, -(2**63)]))
HOSTILE_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e308]))
HOSTILE_STRS = st.one_of(st.text(max_size=40), st.integers(1000, 20000).map(lambda n: "x" * n), st.sampled_from(["", ".", "*", ">"]))
HOSTILE_LISTS = st.integers(0, 30000)  # huge lists, built cheaply (hypothesis would shrink forever)
FP = schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "{}", "v")
LIMITS = Limits(max_senders=8, max_contexts_per_sender=16, max_interval_s=2.0, max_holder_age_s=60.0)
SHA = "a" * 64


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _available(sender_id: str, context_id: str, n: int, tok: int, at: float, nbytes: int) -> dict:
    ev = schemas.CacheAvailable(
        sender_id="s", model_id="m", model_sha256=SHA, fingerprint=FP, fingerprint_id="fp", context_id="c",
        token_ids=[], dtype="float32", kv_nbytes=[1], e_layers=[0], e_nbytes=1, transport="ucx", address="h:1",
        published_at=0.0)
    raw = msgspec.to_builtins(ev)
    raw.update(sender_id=sender_id, context_id=context_id, token_ids=[tok] * n, published_at=at,
               kv_nbytes=[nbytes] * min(n, 64), e_nbytes=nbytes)
    return raw


# One hostile message of each control kind a sender (or an impostor) can put on a cache subject.
control_message = st.one_of(
    st.builds(_available, HOSTILE_STRS, HOSTILE_STRS, HOSTILE_LISTS, HOSTILE_INTS, HOSTILE_FLOATS, HOSTILE_INTS),
    st.builds(lambda s, c: {"type": "cache.evicted", "v": schemas.SCHEMA_VERSION, "sender_id": s, "context_id": c},
              HOSTILE_STRS, HOSTILE_STRS),
    st.builds(lambda s, n, i, at: {"type": "sender.heartbeat", "v": schemas.SCHEMA_VERSION, "sender_id": s, "model_id": "m",
                                   "context_ids": ["c"] * n, "interval_s": i, "sent_at": at},
              HOSTILE_STRS, HOSTILE_LISTS, HOSTILE_FLOATS, HOSTILE_FLOATS),
    st.builds(lambda v: {"type": "sender.heartbeat", "v": v, "sender_id": "s", "model_id": "m", "context_ids": [],
                         "interval_s": 1.0, "sent_at": 0.0}, HOSTILE_INTS),  # a peer on another schema version
)
# Where it is published: its own subject, another sender's, or a malformed one.
subject_for = st.sampled_from(["own", "other", "bad"])


def _subject(msg: dict, where: str) -> str:
    kind = {"cache.available": "available", "cache.evicted": "evicted", "sender.heartbeat": "heartbeat"}[msg["type"]]
    sid = msg.get("sender_id") or "x"
    token = subjects.model_token(sid) if where == "own" else "someone-else"
    return f"dm.cache.{kind}.{token}" if where != "bad" else f"dm.cache.{kind}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(st.tuples(control_message, subject_for), min_size=1, max_size=12))
@example(batch=[({"type": "sender.heartbeat", "v": schemas.SCHEMA_VERSION, "sender_id": "s", "model_id": "m",
                  "context_ids": ["c"], "interval_s": math.inf, "sent_at": 0.0}, "own")])
@example(batch=[(_available("s", "c", 16, 1, 1e300, 1), "own"),
                ({"type": "sender.heartbeat", "v": schemas.SCHEMA_VERSION, "sender_id": "s", "model_id": "m",
                  "context_ids": ["c"], "interval_s": 1e12, "sent_at": 0.0}, "own")])
def test_broker_survives_hostile_control_messages_and_forgets_them(batch):
    """Any sequence of hostile events leaves the broker's handlers unraised, its index within
    its caps and lookups answering; once their senders fall silent, everything is forgotten."""
    clock = Clock()
    ix = CacheIndex(ttl_factor=3.0, clock=clock, limits=LIMITS)

    async def feed() -> None:
        for msg, where in batch:
            await broker.on_sender_event(ix, _no_hello, _subject(msg, where), msgspec.msgpack.encode(msg))
            assert ix.senders() <= LIMITS.max_senders
            assert all(len(h) <= LIMITS.max_contexts_per_sender for h in ix._holders.values())
            await broker.lookup(ix, schemas.LookupRequest(token_ids=[1] * 32, fingerprint_id="fp"))

    asyncio.run(feed())
    ix.expire()
    ix.sweep()
    # Silence: no heartbeat, no announcement. Within the longest liveness and holder age, nothing is left.
    clock.t += 3.0 * LIMITS.max_interval_s + LIMITS.max_holder_age_s + 1
    ix.expire()
    ix.sweep()
    assert len(ix) == 0 and ix.senders() == 0 and not ix._by_key


def test_flood_of_senders_and_contexts_is_capped_with_an_alarm():
    """A flood of new sender ids and contexts stops at the caps, each refusal counted as an alarm."""
    ix = CacheIndex(limits=LIMITS)
    before = alarms()

    async def flood() -> None:
        for i in range(50):
            for j in range(40):
                msg = _available(f"s{i}", f"c{j}", 16, j, 0.0, 1)
                await broker.on_sender_event(ix, _no_hello, subjects.cache_available(f"s{i}"), msgspec.msgpack.encode(msg))

    asyncio.run(flood())
    after = alarms()
    assert ix.senders() == LIMITS.max_senders and len(ix) == LIMITS.max_senders * LIMITS.max_contexts_per_sender
    assert after.get(("cache.available", "too_many_senders"), 0) > before.get(("cache.available", "too_many_senders"), 0)
    assert after.get(("cache.available", "too_many_contexts"), 0) > before.get(("cache.available", "too_many_contexts"), 0)


def test_hostile_events_never_stop_the_brokers_sweep():
    """A broker on an in-process bus fed hostile events keeps its sweep loop running (stays ready)."""
    async def run() -> bool:
        bus = InProcessBus()
        async with BrokerService(BrokerConfig(expire_every_s=0.01), bus=bus) as b:
            for raw in ({"type": "sender.heartbeat", "v": 2, "sender_id": "s", "model_id": "m", "context_ids": [],
                         "interval_s": math.nan, "sent_at": math.inf},
                        _available("s", "c", 16, -1, math.nan, -(2**63)), {"type": "nonsense"}):
                await bus.publish(subjects.sender_heartbeat("s"), msgspec.msgpack.encode(raw))
                await bus.publish(subjects.cache_available("s"), msgspec.msgpack.encode(raw))
            await bus.publish(subjects.cache_available("s"), b"\xc1garbage")
            await bus.settle()
            sweeps = b.metrics.expired_senders
            await until(lambda: b.ready, "ready")
            return b.ready and sweeps is not None

    assert asyncio.run(run())


def _config(version: int = 1, created_at: float = 0.0, groups: list[tuple[int, int]] | None = None,
            quality: float = 0.9, layers: int = 4) -> schemas.RecomputeConfig:
    groups = [(2, 4)] if groups is None else groups
    point = schemas.FrontierPoint(plan=schemas.PlanSpec(groups=groups), recomputed_layers=sum(e - s for s, e in groups),
                                  quality=quality)
    return schemas.RecomputeConfig(
        sender_model="snd", receiver_model="rcv", sender_sha256=SHA, receiver_sha256=SHA, profile_version=version,
        task="t", tolerance=0.05, chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5,
        total_layers=layers, created_at=created_at)


hostile_config = st.builds(
    _config, version=HOSTILE_INTS.filter(lambda v: -(2**63) <= v < 2**63), created_at=HOSTILE_FLOATS,
    groups=st.lists(st.tuples(HOSTILE_INTS.filter(lambda v: abs(v) < 2**63), HOSTILE_INTS.filter(lambda v: abs(v) < 2**63)),
                    max_size=6),
    quality=HOSTILE_FLOATS, layers=HOSTILE_INTS.filter(lambda v: abs(v) < 2**63))


def _receiver_state() -> SimpleNamespace:
    from droidmesh.shared.kv import policy

    return SimpleNamespace(policy_facts=policy.Receiver(model_id="rcv", model_sha256=SHA, num_layers=4),
                           cfg=SimpleNamespace(model_id="rcv"), configs={}, metrics=Metrics("receiver"), holder=None)


def _sender_state() -> SimpleNamespace:
    import torch

    from droidmesh.shared.holding.holder import Holder
    from droidmesh.shared.holding.store import CacheStore

    holder = Holder("snd", InProcessBus(), CacheStore(1 << 20), Metrics("sender"), grant_ttl_s=10.0, heartbeat_s=1.0,
                    authenticated=False)
    return SimpleNamespace(cfg=SimpleNamespace(model_id="snd"), model_sha256=SHA, holder=holder,
                           held=holder.add_model("snd", SHA, torch.float32))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile=st.lists(hostile_config, min_size=1, max_size=4))
@example(hostile=[_config(version=2**62)])
@example(hostile=[_config(created_at=math.inf)])
def test_receivers_and_senders_ignore_hostile_configs_and_keep_the_last_good_one(hostile):
    """Hostile pair configs (invalid plans, NaN qualities, versions far in the future) reach neither
    a receiver's nor a sender's handler: both keep serving with the last good config."""
    good, later = _config(version=5), _config(version=6, groups=[(1, 4)])
    r, s = _receiver_state(), _sender_state()

    async def run() -> None:
        board = InMemoryConfigBoard()
        for cfg in (good, *hostile, later):
            await board.put(cfg)
        for handler in (receiver.on_config, sender.on_config):
            state = r if handler is receiver.on_config else s
            task = asyncio.get_running_loop().create_task(board.watch(lambda c, h=handler, st=state: h(st, c)))
            await asyncio.sleep(0)  # the in-memory board delivers what it holds on its first turn
            for _ in range(20):
                await asyncio.sleep(0)
            task.cancel()

    asyncio.run(run())
    held = r.configs["snd"]
    # the newest honest config wins unless a hostile one was itself admissible (valid, not from the future)
    assert held.profile_version < 2**40 and all(math.isfinite(p.quality) for p in held.frontier)
    assert held.profile_version >= later.profile_version or held in hostile
    assert all(0 < start < 4 for start in s.held.profiled_e.get("rcv", set()))


async def _no_hello(sender_id: str) -> None:
    """The broker's re-announce request, not exercised here."""
