"""Liveness between a holder and the broker: a holder's beat never waits on a publish that cannot
go out (it is logged, the next one tried), a re-announcement to a (new) broker is followed by a
beat at once, and the broker logs a sender once when it is first heard live and again only after
it was declared dead."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from droidmesh.services.cache_broker import handlers
from droidmesh.services.cache_broker.index import CacheIndex
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas, subjects


class StuckBus:
    """A bus whose first `stuck` publishes never complete (a connection that stopped flushing)."""

    def __init__(self, stuck: int) -> None:
        self.stuck, self.sent = stuck, []

    async def publish(self, subject: str, data: bytes) -> None:
        if self.stuck > 0:
            self.stuck -= 1
            await asyncio.Event().wait()
        self.sent.append(subject)


def _holder(bus: StuckBus, heartbeat_s: float) -> Holder:
    return Holder("sender-1", bus, CacheStore(1 << 20), Metrics("sender"), grant_ttl_s=5.0,  # type: ignore[arg-type]
                  heartbeat_s=heartbeat_s, authenticated=False)


def test_a_beat_whose_publish_hangs_is_logged_and_the_next_one_goes_out():
    bus = StuckBus(stuck=1)
    holder = _holder(bus, heartbeat_s=0.05)

    async def run() -> None:
        task = asyncio.create_task(holder.heartbeat())
        while not bus.sent:
            await asyncio.sleep(0.01)
        task.cancel()

    with capture_logs() as logs:
        asyncio.run(asyncio.wait_for(run(), 10.0))
    assert bus.sent[0] == subjects.sender_heartbeat("sender-1")
    assert [e["event"] for e in logs if e["event"] == "heartbeat_failed"] == ["heartbeat_failed"]


def test_a_reannouncement_ends_with_a_beat():
    bus = StuckBus(stuck=0)
    holder = _holder(bus, heartbeat_s=30.0)
    asyncio.run(holder.broker_hello(schemas.BrokerHello(broker_id="broker-2")))
    assert bus.sent == [subjects.sender_heartbeat("sender-1")]  # it holds nothing: only the beat


def test_the_broker_logs_a_sender_when_first_heard_and_after_it_was_declared_dead():
    clock = [0.0]
    index = CacheIndex(clock=lambda: clock[0])
    hb = schemas.SenderHeartbeat(sender_id="s1", model_id="m", context_ids=[], interval_s=1.0, sent_at=0.0)

    async def nobody(sender_id: str) -> None:
        return None

    async def beats() -> None:
        await handlers.on_heartbeat(index, nobody, hb)  # first heard
        clock[0] = 1.0
        await handlers.on_heartbeat(index, nobody, hb)  # still live: not logged
        clock[0] = 10.0
        assert index.expire() == ["s1"]
        await handlers.on_heartbeat(index, nobody, hb)  # back from the dead

    with capture_logs() as logs:
        asyncio.run(beats())
    assert [e["sender_id"] for e in logs if e["event"] == "sender_live"] == ["s1", "s1"]
