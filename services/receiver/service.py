"""Receiver service: generate requests on the model's queue group (copies share the load),
availability events to warm UCX endpoints, recompute configs per sender model."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from services.receiver import handlers
from services.receiver.config import ReceiverConfig
from shared.bus import Bus, NatsBus
from shared.config_board import ConfigBoard, NatsConfigBoard
from shared.kv.plan import ReusePlan
from shared.model.adapter import ModelAdapter, load_model
from shared.profiling.select import select_point
from shared.metrics import HealthServer, Metrics
from shared.service_kit import run_in, start_health, Background, event, rpc
from shared.transport.ucx import BulkClient
from shared.wire import schemas, subjects

log = structlog.get_logger("receiver")
VERSION = "0.1.0"


class ReceiverState:
    """What the handlers share: config, model, bus, UCX client, pair configs, the torch thread."""

    def __init__(self, cfg: ReceiverConfig, bus: Bus, model: ModelAdapter, executor: ThreadPoolExecutor,
                 bg: Background, metrics: Metrics):
        self.cfg, self.bus, self.model, self.executor, self._bg = cfg, bus, model, executor, bg
        self.metrics = metrics
        self.bulk = BulkClient()
        self.pull_slots = asyncio.Semaphore(cfg.max_concurrent_pulls)
        self.configs: dict[str, schemas.RecomputeConfig] = {}  # sender model -> newest profile for us
        self.inflight = 0  # generate requests being served (the torch thread runs one at a time)
        self.bandwidth_bps: float | None = None  # EWMA of measured pull throughput
        self.eos_token_id = model.tokenizer.eos_token_id if model.tokenizer is not None else None
        self._warmed: set[tuple[str, int]] = set()
        self.replies: OrderedDict[str, asyncio.Future] = OrderedDict()  # recent request id -> answer

    def remember(self, request_id: str, fut: asyncio.Future, keep: int = 4096) -> None:
        self.replies[request_id] = fut
        while len(self.replies) > keep:
            self.replies.popitem(last=False)

    def plan_for(self, holder: schemas.CacheAvailable, mode: str, tokens: int, slo_s: float | None
                 ) -> tuple[ReusePlan, tuple[str, str] | None]:
        """The plan for `holder`'s cache, and why it is full prefill when it is."""
        if mode == "full_reuse":
            return ReusePlan.full_reuse(), None
        cfg = self.configs.get(holder.model_id)
        if cfg is not None:
            p = select_point(cfg, queued=self.inflight - 1, tokens=tokens, slo_s=slo_s,
                             bandwidth_bps=self.bandwidth_bps, e_layers=set(holder.e_layers))
            if p is None:
                return ReusePlan.full_prefill(), ("no_e", f"sender holds E for none of the profiled groups {holder.e_layers}")
            return (ReusePlan.recompute(p.start, p.end) if p.end > p.start else ReusePlan.full_reuse()), None
        if self.cfg.default_group:
            s, e = self.cfg.default_group
            if s > 0 and s not in holder.e_layers:
                return ReusePlan.full_prefill(), ("no_e", f"sender holds no E for layer {s} (has {holder.e_layers})")
            return ReusePlan.recompute(s, min(e, self.model.num_layers)), None
        return ReusePlan.full_prefill(), ("no_config", f"no recompute config for {holder.model_id} -> {self.cfg.model_id}")

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            bps = nbytes / seconds
            self.bandwidth_bps = bps if self.bandwidth_bps is None else 0.8 * self.bandwidth_bps + 0.2 * bps

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        return await run_in(self.executor, fn, *args)

    async def warm(self, host: str, port: int) -> None:
        if (host, port) in self._warmed:
            return
        self._warmed.add((host, port))
        self._bg.spawn(self._warm(host, port), f"warm-{host}:{port}")

    async def _warm(self, host: str, port: int) -> None:
        try:
            await self.bulk.warm(host, port)
        except Exception as e:  # a dead sender is found again at pull time; the pull falls back
            self._warmed.discard((host, port))
            log.warning("warm_failed", host=host, port=port, error=repr(e))


class ReceiverService:
    def __init__(self, cfg: ReceiverConfig, bus: Bus | None = None, model: ModelAdapter | None = None,
                 board: ConfigBoard | None = None):
        self.cfg = cfg
        self.metrics = Metrics("receiver")
        self._health: HealthServer | None = None
        self._bus = bus
        self._model = model
        self._board = board
        self._bg = Background()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.state: ReceiverState | None = None

    async def __aenter__(self) -> ReceiverService:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        model = self._model or await loop.run_in_executor(
            self._executor, functools.partial(load_model, cfg.model_path, dtype=cfg.dtype, name=cfg.model_id))
        if model.tokenizer is None:
            raise ValueError(f"{cfg.model_path} has no tokenizer; the receiver serves text")
        bus = self._bus or await NatsBus.connect(None, "droidmesh-receiver", VERSION, **self.cfg.nats_options())
        s = self.state = ReceiverState(cfg, bus, model, self._executor, self._bg, self.metrics)
        board = self._board or NatsConfigBoard(bus.nc)  # type: ignore[attr-defined]
        self._bg.spawn(board.watch(functools.partial(handlers.on_config, s)), "config-watch")
        await bus.subscribe(subjects.CACHE_AVAILABLE, event(schemas.CacheAvailable, functools.partial(handlers.on_available, s)))
        await bus.serve(subjects.receiver_generate(cfg.model_id),
                        rpc(schemas.GenerateRequest, functools.partial(handlers.generate, s)),
                        queue=subjects.receiver_queue(cfg.model_id))
        log.info("receiver_started", model_id=cfg.model_id, receiver_id=cfg.receiver_id,
                 fingerprint=model.fingerprint.id, layers=model.num_layers)
        self._health = start_health(self.metrics, self.cfg.metrics_port)
        if self._health is not None:
            self._health.ready = True
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._health is not None:
            self._health.ready = False  # stop routing probes' traffic here first
        s = self.state
        await self._bg.close()  # config watch, endpoint warm-ups: nothing a request waits on
        if s is not None and self._bus is None:
            await s.bus.close()  # type: ignore[attr-defined]  # drain: in-flight requests finish first
        if s is not None:
            await s.bulk.close()
        self._executor.shutdown(wait=True)
        if self._health is not None:
            await self._health.close()
