"""Profiler service: profile requests on a queue group (copies share the work); results go to
the recompute-config bucket that receivers and senders watch."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from services.profiler import handlers
from services.profiler.config import ProfilerConfig
from shared.bus import Bus, NatsBus
from shared.config_board import ConfigBoard, NatsConfigBoard
from shared.metrics import HealthServer, Metrics
from shared.service_kit import run_in, start_health, rpc
from shared.wire import schemas, subjects

log = structlog.get_logger("profiler")
VERSION = "0.1.0"


class ProfilerState:
    def __init__(self, cfg: ProfilerConfig, board: ConfigBoard, executor: ThreadPoolExecutor):
        self.cfg, self.board, self.executor = cfg, board, executor

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        return await run_in(self.executor, fn, *args)


class ProfilerService:
    def __init__(self, cfg: ProfilerConfig, bus: Bus | None = None, board: ConfigBoard | None = None):
        self.cfg = cfg
        self.metrics = Metrics("profiler")
        self._health: HealthServer | None = None
        self._bus = bus
        self._board = board
        self._own_bus: NatsBus | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def __aenter__(self) -> ProfilerService:
        bus = self._bus
        if bus is None:
            bus = self._own_bus = await NatsBus.connect(None, "droidmesh-profiler", VERSION, **self.cfg.nats_options())
        board = self._board or NatsConfigBoard(bus.nc)  # type: ignore[attr-defined]
        state = ProfilerState(self.cfg, board, self._executor)
        await bus.serve(subjects.PROFILER_PROFILE, rpc(schemas.ProfileRequest, functools.partial(handlers.profile, state)),
                        queue=subjects.PROFILER_QUEUE)
        log.info("profiler_started")
        self._health = start_health(self.metrics, self.cfg.metrics_port)
        if self._health is not None:
            self._health.ready = True
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._health is not None:
            self._health.ready = False  # stop routing probes' traffic here first
        if self._own_bus is not None:
            await self._own_bus.close()
        self._executor.shutdown(wait=True)
        if self._health is not None:
            await self._health.close()
