"""Cache-broker service: events -> index; lookups answered by any copy (queue group).

Every broker copy keeps the whole index (events fan out to all copies, lookups go to one), so
copies are interchangeable. On start a broker publishes `BrokerHello`: senders re-announce what
they hold, and the liveness gate keeps it from serving anyone it has not heard from.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import structlog

from services.cache_broker import handlers
from services.cache_broker.config import BrokerConfig
from services.cache_broker.index import CacheIndex
from shared.bus import Bus, NatsBus
from shared.metrics import HealthServer, Metrics
from shared.service_kit import start_health, Background, event, rpc
from shared.wire import schemas, subjects

log = structlog.get_logger("broker")
VERSION = "0.1.0"


class BrokerService:
    def __init__(self, cfg: BrokerConfig, bus: Bus | None = None):
        self.cfg = cfg
        self.metrics = Metrics("cache_broker")
        self._health: HealthServer | None = None
        self._bus = bus
        self._own_bus: NatsBus | None = None
        self._bg = Background()
        self.index = CacheIndex(ttl_factor=cfg.ttl_factor)

    async def __aenter__(self) -> BrokerService:
        bus = self._bus
        if bus is None:
            bus = self._own_bus = await NatsBus.connect(None, "droidmesh-broker", VERSION, **self.cfg.nats_options())
        ix = self.index
        await bus.subscribe(subjects.CACHE_AVAILABLE, event(schemas.CacheAvailable, functools.partial(handlers.on_available, ix)))
        await bus.subscribe(subjects.CACHE_EVICTED, event(schemas.CacheEvicted, functools.partial(handlers.on_evicted, ix)))
        await bus.subscribe(subjects.SENDER_HEARTBEAT, event(schemas.SenderHeartbeat, functools.partial(handlers.on_heartbeat, ix)))
        await bus.serve(subjects.BROKER_LOOKUP, rpc(schemas.LookupRequest, functools.partial(handlers.lookup, ix)),
                        queue=subjects.BROKER_QUEUE)
        await bus.publish(subjects.BROKER_HELLO, schemas.encode(schemas.BrokerHello(broker_id=self.cfg.broker_id)))
        self.metrics.index_contexts.set_function(lambda: len(ix))
        self._bg.spawn(self._expire_loop(), "expire")
        log.info("broker_started", broker_id=self.cfg.broker_id)
        self._health = start_health(self.metrics, self.cfg.metrics_port)
        if self._health is not None:
            self._health.ready = True
        return self

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.expire_every_s)
            for sender in self.index.expire():
                self.metrics.expired_senders.inc()
                log.info("sender_expired", sender_id=sender)

    async def __aexit__(self, *exc: Any) -> None:
        if self._health is not None:
            self._health.ready = False  # stop routing probes' traffic here first
        await self._bg.close()
        if self._own_bus is not None:
            await self._own_bus.close()
        if self._health is not None:
            await self._health.close()
