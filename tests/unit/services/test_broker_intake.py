"""The broker's intake of sender events: per-sender budgets of events and loop time (token buckets),
deferral in order and then dropping, heartbeats ahead of a flood, over-budget counted and logged
once an interval; and the budgets' settings."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from droidmesh.services.cache_broker.budget import Bucket, LogThrottle
from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.index import CacheIndex
from droidmesh.services.cache_broker.intake import QUEUED_OVERHEAD, Budgets, Intake
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas, subjects

FP = schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "{}", "v")


class Clock:
    def __init__(self, step: float = 0.0) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def _available(sender: str, cid: str, n: int = 64) -> tuple[str, bytes]:
    # Token ids fixed per context and all in [1000, 61000): each encodes to the same number of bytes,
    # so every event has one size (queue budgets count bytes). A salted `hash()` made sizes, and the
    # number of events a byte budget holds, vary from run to run.
    ev = schemas.CacheAvailable(
        sender_id=sender, model_id="m", fingerprint=FP, fingerprint_id="fp", context_id=cid,
        token_ids=[1000 + (sum(map(ord, cid)) * 131 + i * 7919) % 60000 for i in range(n)],
        model_sha256="x", dtype="float32", kv_nbytes=[1],
        e_layers=[0], e_nbytes=1, transport="ucx", address="h:1", published_at=0.0)
    return subjects.cache_available(sender), schemas.encode(ev)


def _evicted(sender: str, cid: str) -> tuple[str, bytes]:
    return subjects.cache_evicted(sender), schemas.encode(schemas.CacheEvicted(sender_id=sender, context_id=cid))


def _heartbeat(sender: str, held: tuple[str, ...] = ()) -> tuple[str, bytes]:
    hb = schemas.SenderHeartbeat(sender_id=sender, model_id="m", context_ids=list(held), interval_s=1.0, sent_at=0.0)
    return subjects.sender_heartbeat(sender), schemas.encode(hb)


async def _no_hello(sender_id: str) -> None:
    return None


def _intake(budgets: Budgets, clock: Clock, timer: Clock | None = None) -> tuple[Intake, CacheIndex, Metrics]:
    ix, metrics = CacheIndex(clock=clock), Metrics("cache_broker")
    return Intake(ix, _no_hello, budgets, metrics.over_budget, clock=clock, timer=timer or Clock()), ix, metrics


async def _drain(intake: Intake, clock: Clock) -> None:
    """Let the budgets refill and take turns until nothing waits (at most 100 turns)."""
    for _ in range(100):
        if not intake.queued_events:
            return
        clock.t += 10.0
        await intake.turn()
    raise AssertionError(f"{intake.queued_events} events still waiting")


def _over(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("dm_broker_over_budget_total", {"reason": reason}) or 0.0


def _held(ix: CacheIndex, sender: str) -> list[str]:
    return list(ix._holders.get(sender, {}))


def test_a_flooding_sender_waits_then_is_dropped_while_others_and_heartbeats_go_at_once():
    """Past its event budget a sender's events wait (in order) up to its queue's bytes, then are
    dropped; another sender's event and the flooder's own heartbeat are handled at once; the
    waiting ones are handled as the budget refills."""
    clock = Clock()
    size = len(_available("a", "c00")[1]) + QUEUED_OVERHEAD
    budgets = Budgets(events_per_s=1.0, event_burst=2, max_queued_bytes_per_sender=3 * size)
    intake, ix, metrics = _intake(budgets, clock)

    async def run() -> tuple[list[str], list[str], bool, list[str]]:
        for i in range(10):
            await intake.on_event(*_available("a", f"c{i:02d}"))
        await intake.on_event(*_available("b", "b0"))
        await intake.on_event(*_heartbeat("a", ("c00", "c01")))
        at_once = (_held(ix, "a"), _held(ix, "b"), ix.live("a"))
        assert await intake.turn() > 0  # nothing may go before the budget refills
        await _drain(intake, clock)
        return *at_once, _held(ix, "a")

    first, others, heard, after = asyncio.run(run())
    assert first == ["c00", "c01"] and others == ["b0"] and heard
    assert after == ["c00", "c01", "c02", "c03", "c04"]
    assert _over(metrics, "deferred") == 3 and _over(metrics, "dropped") == 5
    assert intake.queued_bytes == 0


def test_a_senders_events_keep_their_order_through_the_queue():
    """An eviction waiting behind its announcement is applied after it: the context ends up gone."""
    clock = Clock()
    intake, ix, _ = _intake(Budgets(events_per_s=1.0, event_burst=1), clock)

    async def run() -> list[str]:
        await intake.on_event(*_available("a", "x"))
        await intake.on_event(*_available("a", "y"))
        await intake.on_event(*_evicted("a", "y"))
        await intake.on_event(*_available("a", "z"))
        await _drain(intake, clock)
        return _held(ix, "a")

    assert asyncio.run(run()) == ["x", "z"]


def test_loop_time_bounds_what_one_sender_gets():
    """Each event's measured cost comes off its sender's loop-time bucket: once spent, its next
    events wait; another sender's do not."""
    clock = Clock()
    intake, ix, metrics = _intake(Budgets(cpu_share=0.1, cpu_burst_s=0.5), clock, timer=Clock(step=0.3))

    async def run() -> None:
        for i in range(5):
            await intake.on_event(*_available("a", f"c{i}"))
        await intake.on_event(*_available("b", "b0"))

    asyncio.run(run())
    # every event costs 0.3 s on the stepping timer: 0.5 -> 0.2 -> -0.1, then a's wait
    assert _held(ix, "a") == ["c0", "c1"] and _held(ix, "b") == ["b0"]
    assert _over(metrics, "deferred") == 3


def test_a_returning_sender_is_asked_to_reannounce_unless_its_announcements_are_waiting():
    """A heartbeat overtaking its sender's waiting events does not ask for them again."""
    clock = Clock()
    asked: list[str] = []

    async def hello(sender_id: str) -> None:
        asked.append(sender_id)

    intake = Intake(CacheIndex(clock=clock), hello, Budgets(events_per_s=1.0, event_burst=1), clock=clock, timer=Clock())

    async def run() -> None:
        for cid in ("x", "y"):  # y waits for the budget
            await intake.on_event(*_available("a", cid))
        await intake.on_event(*_heartbeat("a", ("x", "y")))
        await _drain(intake, clock)
        await intake.on_event(*_heartbeat("b", ("z",)))  # nothing of b's waiting: asked

    asyncio.run(run())
    assert asked == ["b"]


def test_heartbeats_past_their_rate_are_dropped():
    clock = Clock()
    intake, ix, metrics = _intake(Budgets(heartbeats_per_s=2.0), clock)

    async def run() -> None:
        for _ in range(5):
            await intake.on_event(*_heartbeat("a"))

    asyncio.run(run())
    assert ix.live("a") and _over(metrics, "heartbeat_dropped") == 3


def test_over_budget_is_logged_once_an_interval_with_what_it_stood_for():
    clock = Clock()
    intake, _, metrics = _intake(Budgets(events_per_s=1.0, event_burst=1, max_queued_bytes_per_sender=1,
                                         log_every_s=10.0), clock)

    async def run() -> None:
        for i in range(51):
            await intake.on_event(*_available("a", f"c{i}"))
        clock.t += 11.0
        await intake.on_event(*_available("a", "late"))  # the budget refilled: handled
        for i in range(2):
            await intake.on_event(*_available("a", f"d{i}"))

    with capture_logs() as logs:
        asyncio.run(run())
    lines = [(e["reason"], e["events"]) for e in logs if e["event"] == "sender_over_budget"]
    assert lines == [("dropped", 1), ("dropped", 50)]
    assert _over(metrics, "dropped") == 52


def test_senders_past_the_tracked_cap_are_dropped_and_idle_ones_forgotten():
    clock = Clock()
    intake, ix, metrics = _intake(Budgets(max_senders=2), clock)

    async def run() -> None:
        for s in ("a", "b", "c"):
            await intake.on_event(*_available(s, "x"))

    asyncio.run(run())
    assert ix.senders() == 2 and _over(metrics, "too_many_senders") == 1
    clock.t += 100.0  # a and b idle long enough for their buckets to be full again: forgotten
    asyncio.run(intake.on_event(*_available("c", "x")))
    assert _held(ix, "c") == ["x"]


def test_a_bad_subject_is_refused_without_a_budget():
    intake, ix, _ = _intake(Budgets(), Clock())
    asyncio.run(intake.on_event("dm.cache.nonsense.a", b"x"))
    asyncio.run(intake.on_event("dm.cache.available", b"x"))
    assert len(ix) == 0 and not intake._senders


def test_bucket_refills_up_to_its_burst_and_may_be_overspent():
    b = Bucket.full(rate=2.0, burst=4.0, now=0.0)
    assert all(b.take(0.0) for _ in range(4)) and not b.take(0.0)
    assert b.wait_s(0.0, 1.0) == pytest.approx(0.5) and b.take(0.5)
    b.spend(3.0)
    assert b.wait_s(0.5, 0.0) == pytest.approx(1.5) and b.is_full(100.0)


def test_log_throttle_reports_what_it_held_back():
    clock = Clock()
    t = LogThrottle(5.0, clock)
    assert [t.due("k") for _ in range(4)] == [1, 0, 0, 0]
    clock.t += 5.0
    assert t.due("k", 2) == 5 and t.due("other") == 1


@pytest.mark.parametrize("bad", [{"sender_cpu_share": 0.0}, {"sender_events_per_s": float("nan")},
                                 {"max_sender_index_bytes": 0}, {"max_indexed_blocks": 0}, {"over_budget_log_s": -1.0}])
def test_budget_settings_are_validated(bad):
    BrokerConfig()
    with pytest.raises(ConfigError):
        BrokerConfig(**bad)
