"""Sender service: wires the bus and the UCX server to the handlers.

Lifecycle: load the model (worker thread) -> start the UCX listener on an ephemeral port ->
serve generate/prefill requests -> heartbeat; on exit withdraw every cache (eviction events),
stop serving, drain the bus.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from services.sender import handlers
from services.sender.config import SenderConfig
from services.sender.store import CacheStore
from shared.bus import Bus, NatsBus
from shared.config_board import ConfigBoard, NatsConfigBoard
from shared.model.adapter import ModelAdapter, load_model
from shared.metrics import HealthServer, Metrics
from shared.service_kit import run_in, start_health, Background, event, rpc
from shared.transport.tokens import TokenIssuer
from shared.transport.ucx import BulkServer
from shared.wire import schemas, subjects

log = structlog.get_logger("sender")
VERSION = "0.1.0"


class SenderState:
    """What the handlers share: config, model, store, bus, and the torch worker thread."""

    def __init__(self, cfg: SenderConfig, bus: Bus, model: ModelAdapter, executor: ThreadPoolExecutor,
                 metrics: Metrics):
        self.cfg, self.bus, self.model, self.executor, self.metrics = cfg, bus, model, executor, metrics
        self.store = CacheStore(cfg.store_bytes)
        metrics.store_bytes.set_function(lambda: self.store.nbytes)
        metrics.store_contexts.set_function(lambda: len(self.store.ids()))
        self.ucx_port = 0
        self.profiled_e_layers: dict[str, set[int]] = {}  # receiver model -> group starts it may use
        self.tokens = TokenIssuer(cfg.token_ttl_s)
        self.announced_until: dict[str, float] = {}  # context -> expiry of its last announced token

    def e_layers(self) -> list[int]:
        """Configured E layers plus every group start a profiled receiver may choose online."""
        return sorted(set(self.cfg.e_layers).union(*self.profiled_e_layers.values()))

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        """Run torch work on the single worker thread (never on the event loop)."""
        return await run_in(self.executor, fn, *args)


class SenderService:
    def __init__(self, cfg: SenderConfig, bus: Bus | None = None, model: ModelAdapter | None = None,
                 board: ConfigBoard | None = None):
        self.cfg = cfg
        self.metrics = Metrics("sender")
        self._health: HealthServer | None = None
        self._bus = bus
        self._model = model
        self._board = board
        self._bg = Background()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self._server: BulkServer | None = None
        self.state: SenderState | None = None

    async def __aenter__(self) -> SenderService:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        model = self._model or await loop.run_in_executor(
            self._executor, functools.partial(load_model, cfg.model_path, dtype=cfg.dtype, name=cfg.model_id))
        bus = self._bus or await NatsBus.connect(None, "droidmesh-sender", VERSION, **self.cfg.nats_options())
        s = self.state = SenderState(cfg, bus, model, self._executor, self.metrics)
        self._server = BulkServer(s.store.tensor, functools.partial(handlers.authorize, s))
        s.ucx_port = self._server.start(cfg.ucx_port)
        await bus.serve(subjects.sender_generate(cfg.model_id),
                        rpc(schemas.GenerateRequest, functools.partial(handlers.generate, s)), queue="senders")
        await bus.serve(subjects.sender_prefill(cfg.model_id),
                        rpc(schemas.PrefillRequest, functools.partial(handlers.prefill, s)), queue="senders")
        await bus.subscribe(subjects.BROKER_HELLO, event(schemas.BrokerHello, functools.partial(handlers.broker_hello, s)))
        self._bg.spawn(self._heartbeat(s), "heartbeat")
        board = self._board or NatsConfigBoard(bus.nc)  # type: ignore[attr-defined]
        self._bg.spawn(board.watch(functools.partial(handlers.on_config, s)), "config-watch")
        log.info("sender_started", model_id=cfg.model_id, sender_id=cfg.sender_id, ucx_port=s.ucx_port,
                 fingerprint=model.fingerprint.id, layers=model.num_layers)
        self._health = start_health(self.metrics, self.cfg.metrics_port)
        if self._health is not None:
            self._health.ready = True
        return self

    async def _heartbeat(self, s: SenderState) -> None:
        while True:
            msg = schemas.SenderHeartbeat(sender_id=s.cfg.sender_id, model_id=s.cfg.model_id,
                                          context_ids=s.store.ids(), interval_s=s.cfg.heartbeat_s, sent_at=time.time())
            await s.bus.publish(subjects.SENDER_HEARTBEAT, schemas.encode(msg))
            await handlers.refresh_tokens(s)
            await asyncio.sleep(s.cfg.heartbeat_s)

    async def __aexit__(self, *exc: Any) -> None:
        if self._health is not None:
            self._health.ready = False  # stop routing probes' traffic here first
        await self._bg.close()
        s = self.state
        if s is not None:
            for cid in s.store.ids():  # withdraw: nobody should be sent here any more
                await s.bus.publish(subjects.CACHE_EVICTED, schemas.encode(
                    schemas.CacheEvicted(sender_id=s.cfg.sender_id, context_id=cid)))
            if self._bus is None:
                await s.bus.close()  # type: ignore[attr-defined]
        if self._server is not None:
            await self._server.close()
        self._executor.shutdown(wait=True)
        if self._health is not None:
            await self._health.close()
