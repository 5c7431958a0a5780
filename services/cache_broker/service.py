"""Cache-broker service: events -> index; lookups answered by any copy (queue group).

Every broker copy keeps the whole index (events fan out to all copies, lookups go to one), so
copies are interchangeable. On start a broker publishes `BrokerHello`: senders re-announce what
they hold, and the liveness gate keeps it from serving anyone it has not heard from. Dead senders
and stale holders are swept by a supervised loop (restarted if it crashes; the broker is not ready meanwhile).
Sender events pass through `Intake`, which holds each sender to its budgets of events and loop
time (its drain loop is supervised too); the index holds each to its budget of bytes.
The broker imports no torch: its process holds only the index.
"""

from __future__ import annotations

import asyncio
import functools

import structlog

from droidmesh.services.cache_broker import handlers
from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.index import CacheIndex, Limits
from droidmesh.services.cache_broker.intake import Budgets, Intake
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.service.runtime import ServiceRuntime
from droidmesh.shared.service.wrappers import rpc
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("broker")


class BrokerService(ServiceRuntime[BrokerConfig]):
    nats_name = "droidmesh-broker"

    def __init__(self, cfg: BrokerConfig, bus: Bus | None = None):
        super().__init__("cache_broker", cfg, bus)
        self._bus: Bus  # set by start(), before any handler runs
        self.index = CacheIndex(ttl_factor=cfg.ttl_factor, limits=Limits(
            max_senders=cfg.max_senders, max_contexts_per_sender=cfg.max_contexts_per_sender,
            max_interval_s=cfg.max_heartbeat_s, max_holder_age_s=cfg.max_holder_age_s,
            max_indexed_blocks=cfg.max_indexed_blocks, max_sender_bytes=cfg.max_sender_index_bytes,
            max_index_bytes=cfg.max_index_bytes))
        self.intake = Intake(self.index, self._hello, Budgets(
            events_per_s=cfg.sender_events_per_s, event_burst=cfg.sender_event_burst, cpu_share=cfg.sender_cpu_share,
            cpu_burst_s=cfg.sender_cpu_burst_s, heartbeats_per_s=cfg.sender_heartbeats_per_s,
            max_queued_bytes_per_sender=cfg.max_queued_bytes_per_sender, max_queued_bytes=cfg.max_queued_bytes,
            max_senders=2 * cfg.max_senders, log_every_s=cfg.over_budget_log_s), self.metrics.over_budget)

    async def start(self) -> None:
        bus = self._bus = await self.connect()
        ix = self.index
        # every sender's events on its own subject; the handler checks the speaker against it
        await bus.subscribe_from(subjects.CACHE_EVENTS, self.intake.on_event)
        await bus.serve(subjects.BROKER_LOOKUP, rpc(schemas.LookupRequest, functools.partial(handlers.lookup, ix)),
                        queue=subjects.BROKER_QUEUE)
        await bus.publish(subjects.BROKER_HELLO, schemas.encode(schemas.BrokerHello(broker_id=self.cfg.broker_id)))
        self.metrics.index_contexts.set_function(lambda: len(ix))
        self.metrics.index_senders.set_function(ix.senders)
        self.metrics.index_bytes.set_function(lambda: ix.nbytes)
        self.metrics.queued_events.set_function(lambda: self.intake.queued_events)
        self.tasks.supervise("expire", self._expire_loop)
        self.tasks.supervise("intake", self.intake.run)
        log.info("broker_started", broker_id=self.cfg.broker_id)

    async def _hello(self, sender_id: str) -> None:
        """Ask one sender (or, with "", all) to re-announce what it holds."""
        await self._bus.publish(subjects.BROKER_HELLO, schemas.encode(schemas.BrokerHello(broker_id=self.cfg.broker_id,
                                                                                          sender_id=sender_id)))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.expire_every_s)
            for sender in self.index.expire():
                self.metrics.expired_senders.inc()
                log.info("sender_expired", sender_id=sender)
            swept = self.index.sweep()
            if swept:
                self.metrics.swept_holders.inc(swept)
                log.info("holders_swept", holders=swept)
