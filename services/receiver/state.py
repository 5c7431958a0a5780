"""What the receiver's handlers and pipeline share (`ReceiverState`), apart from the service
that builds it (`service.py`), so handlers never import the service."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from droidmesh.services.receiver.answer_stream import ListenerWatch
from droidmesh.services.receiver.breaker import Breaker
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.pipeline import Translation
from droidmesh.services.receiver.relay_watch import QualityWatch
from droidmesh.shared.errors import DeadlineExceededError
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.pool import KVPool
from droidmesh.shared.kv.screen import Screen
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.graphs import cuda_capture
from droidmesh.shared.service.batching import DecodeBatcher
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.service.runtime import Supervisor
from droidmesh.shared.transport.address import link_of
from droidmesh.shared.transport.bulk import BulkClient, make_client
from droidmesh.shared.wire import schemas

log = structlog.get_logger("receiver")


class ReceiverState:
    """What the handlers share: config, model (and its weights' sha256), bus, bulk client, pair
    configs, the torch thread, the per-holder circuit breaker and the recent replies."""

    def __init__(self, cfg: ReceiverConfig, bus: Bus, model: ModelAdapter, model_sha256: str,
                 run_torch: Callable[..., Awaitable[Any]], tasks: Supervisor, metrics: Metrics,
                 bulk: BulkClient | None = None):
        self.cfg, self.bus, self.model, self._torch, self._tasks = cfg, bus, model, run_torch, tasks
        self.metrics = metrics
        # decode steps of this model's requests run together (continuous batching)
        self.batcher = DecodeBatcher(model, run_torch, cfg.max_batch, on_step=self._decoded, pool=decode_pool(cfg, model))
        self.bulk = bulk if bulk is not None else make_client(cfg.transport)  # shared by a process's served models
        # What the reuse policy knows of this receiver.
        self.policy_facts = policy.Receiver(model_id=cfg.model_id, model_sha256=model_sha256,
                                            num_layers=model.num_layers, default_group=cfg.default_group,
                                            min_reuse_fraction=cfg.min_reuse_fraction)
        self.pull_slots = asyncio.Semaphore(cfg.max_concurrent_pulls)
        self.configs: dict[str, schemas.RecomputeConfig] = {}  # sender model -> newest profile for us
        self.maps_failures: dict[str, str] = {}  # SCD maps sha256 -> why it could not be loaded
        # translated pairs: source model -> its loaded translator; why each other one was refused
        # (filled at start: `pipeline.load_translators`)
        self.translations: dict[str, Translation] = {}
        self.translator_failures: list[str] = []
        # the KV screen's reference (`pipeline.screen_for`): built once on the torch thread (one
        # capturing prefill of a fixed text); concurrent first requests await the same build
        self.screen_build: asyncio.Task[Screen | None] | None = None
        self.inflight = 0  # generate requests being served (prefilling, decoding in the batch, or queued)
        self.pull_rates = policy.PullRates()  # what pulls achieved, per holder, per link and over all
        self.reuse_overhead_s = 0.0  # EWMA of a reuse's fixed cost (the grant round trip)
        self.calibration = policy.Calibration()  # measured / predicted TTFT per way of serving
        self.queue_wait = policy.QueueWait()  # how long a request holds the compute thread, recently
        self.rng = random.Random()  # the audit's assignments
        self.shadow_agreements: deque[float] = deque(maxlen=1024)  # recent shadow token agreements
        self.shadow_lock = asyncio.Lock()  # one shadow runs at a time (relay_watch.shadow)
        self.watch = QualityWatch(cfg.quality_window, min_samples=max(1, cfg.quality_window // 2),
                                  threshold=cfg.quality_threshold)
        self.eos_token_id = model.tokenizer.eos_token_id if model.tokenizer is not None else None
        self._warmed: set[str] = set()  # bulk addresses connected ahead of a pull
        # Recent (request id, caller, digest of the request's bytes) -> answer: a retry or a redelivery
        # shares the first copy's answer; another request reusing a known id gets its own.
        self.replies: OrderedDict[tuple[str, str, bytes], asyncio.Future] = OrderedDict()
        self.breaker = Breaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
        self.listeners: ListenerWatch | None = None  # set by the service once connected (None: in-process bus)
        self.holder: Holder | None = None  # set by the service when it holds what it prefills (`hold`)

    def _decoded(self, rows: int) -> None:
        self.metrics.decode_steps.inc()
        self.metrics.decode_rows.inc(rows)

    def hold_layers(self) -> list[int]:
        """The layers whose E a held prefill keeps ([]: this receiver holds nothing): `hold_e_layers`,
        those the pair configs naming this model as the sender use, and the default group's start
        (the models this process serves beside it reuse its contexts by that group)."""
        if self.holder is None:
            return []
        configured = (*self.cfg.hold_e_layers, *self.cfg.default_group[:1])
        return self.holder.models[self.cfg.model_id].e_layers(configured, self.model.num_layers)

    def holds(self, holder: schemas.CacheAvailable) -> bool:
        """Whether `holder` is this receiver's own holder (then its context is read in process)."""
        return self.holder is not None and holder.sender_id == self.holder.id

    def remember(self, key: tuple[str, str, bytes], fut: asyncio.Future, keep: int = 4096) -> None:
        self.replies[key] = fut
        while len(self.replies) > keep:
            self.replies.popitem(last=False)

    def observe_pull(self, holder: schemas.CacheAvailable, nbytes: int, seconds: float, overhead_s: float) -> None:
        """After a pull from `holder`: its throughput and the fixed cost before it (EWMAs)."""
        self.reuse_overhead_s = 0.8 * self.reuse_overhead_s + 0.2 * max(0.0, overhead_s)
        self.pull_rates.observe(holder.sender_id, link_of(holder.transport, holder.address), nbytes, seconds)

    def bandwidth_of(self, holder: schemas.CacheAvailable) -> float | None:
        """What pulls from `holder` achieved lately (from its link, or any holder, when it is new)."""
        return self.pull_rates.of(holder.sender_id, link_of(holder.transport, holder.address))

    async def run_torch(self, fn: Any, *args: Any, deadline: float | None = None) -> Any:
        """Run torch work on the service's single worker thread (never on the event loop). With
        `deadline` (time.monotonic()), a job still queued when it passes is dropped unrun
        (`DeadlineExceededError`): the thread never computes an answer nobody waits for."""
        def job() -> Any:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError("deadline passed while queued for the compute thread; dropped")
            return fn(*args)

        return await self._torch(job)

    def background(self, coro: Any, name: str) -> None:
        """Run `coro` as a supervised background task of the service (logged if it fails)."""
        self._tasks.spawn(coro, name)

    async def warm(self, address: str) -> None:
        """Connect to a sender's bulk address in the background, once."""
        if address in self._warmed:
            return
        self._warmed.add(address)
        self._tasks.spawn(self._warm(address), f"warm-{address}")

    async def _warm(self, address: str) -> None:
        try:
            await self.bulk.warm(address)
        except Exception as e:  # a dead sender is found again at pull time; the pull falls back
            self._warmed.discard(address)
            log.warning("warm_failed", address=address, error=repr(e))


def decode_pool(cfg: ReceiverConfig, model: ModelAdapter) -> KVPool | None:
    """The batch's decode pool (`decode_pool_tokens`; None: off), its steps captured as CUDA graphs
    on a CUDA device unless `cuda_graphs` is off. Allocated (and captured) by `KVPool.warm`."""
    if not cfg.decode_pool_tokens:
        return None
    graphs = cfg.cuda_graphs and model.device.type == "cuda"
    return KVPool(model, cfg.max_batch, cfg.decode_pool_tokens, cuda_capture() if graphs else None)
