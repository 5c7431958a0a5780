"""Cache-broker service: events -> index; lookups answered by any copy (queue group).

Every broker copy keeps the whole index (events fan out to all copies, lookups go to one), so
copies are interchangeable. On start a broker publishes `BrokerHello`: senders re-announce what
they hold, and the liveness gate keeps it from serving anyone it has not heard from. Dead senders
and stale holders are swept by a supervised loop (restarted if it crashes; the broker is not ready meanwhile).
The broker imports no torch: its process holds only the index.
"""

from __future__ import annotations

import asyncio
import functools

import structlog
from droidmesh.services.cache_broker import handlers
from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.index import CacheIndex, Limits
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
            max_interval_s=cfg.max_heartbeat_s, max_holder_age_s=cfg.max_holder_age_s))

    async def start(self) -> None:
        bus = self._bus = await self.connect()
        ix = self.index
        # every sender's events on its own subject; the handler checks the speaker against it
        await bus.subscribe_from(subjects.CACHE_EVENTS, functools.partial(handlers.on_sender_event, ix, self._hello))
        await bus.serve(subjects.BROKER_LOOKUP, rpc(schemas.LookupRequest, functools.partial(handlers.lookup, ix)),
                        queue=subjects.BROKER_QUEUE)
        await bus.publish(subjects.BROKER_HELLO, schemas.encode(schemas.BrokerHello(broker_id=self.cfg.broker_id)))
        self.metrics.index_contexts.set_function(lambda: len(ix))
        self.metrics.index_senders.set_function(ix.senders)
        self.tasks.supervise("expire", self._expire_loop)
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
