"""An engine's prefills as held contexts: another engine (vLLM) as a DroidMesh sender.

With `hold` set, the connector hands every prompt the engine prefilled itself (not one it loaded
from the mesh) to an `EngineHolder` in the engine's worker process: the K/V of every layer as the
engine computed them, copied out of its cache before the step returns. The holder then, on its own
thread, computes E at the layers the pair configs naming this model as the sender use (and
`hold_e_layers`) with DroidMesh's copy of the weights (`kv/capture.captured_from_engine`: the
layers below the last E only), and holds the context as a DroidMesh sender holds its captures:
one store under `store_bytes`, one bulk server, single-use grants to the models' readers,
availability events and heart-beats under `holder_id`, all on the bridge's event loop. Nothing
here blocks the engine's step longer than the copy; a context the store cannot take is skipped.

Scope: every context is held in the connector's `scope`, which the operator sets (`public` lets
every client of the mesh reuse what this engine prefilled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from droidmesh.shared.engines.models import EngineModels
from droidmesh.shared.engines.settings import EngineSettings
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.holding import grants
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.kv.capture import captured_from_engine
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.device import resolve_dtype
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.transport.bulk import BulkServer, make_server
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.hashing import held_context_id

log = structlog.get_logger("engine_holder")
KV = tuple[torch.Tensor, torch.Tensor]
MAX_PENDING = 4  # prompts copied out and waiting for their E: the memory a burst of prefills may take


class EngineHolder:
    """Started on the bridge's loop (`start`); `hold` is called from the engine's worker thread."""

    def __init__(self, cfg: EngineSettings, bus: Bus, loop: asyncio.AbstractEventLoop, models: EngineModels):
        self.cfg, self.bus, self.loop, self._models = cfg, bus, loop, models
        self.store = CacheStore(cfg.store_bytes, cfg.pull_bytes)
        self.holder = Holder(cfg.holder_id, bus, self.store, Metrics("engine"), grant_ttl_s=cfg.grant_ttl_s,
                             heartbeat_s=cfg.heartbeat_s, authenticated=bool(cfg.nats_user))
        self._sha = {m: weights_sha256(p) for m, p in cfg.models.items()}
        for model_id, sha in self._sha.items():
            self.holder.add_model(model_id, sha, resolve_dtype(cfg.dtype, cfg.device), cfg.readers)
        self._server: BulkServer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        # E is computed here, one context at a time, beside the engine's own threads
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="droidmesh-hold")
        self._pending = threading.BoundedSemaphore(MAX_PENDING)

    async def start(self) -> None:
        cfg = self.cfg
        self._server = make_server(cfg.transport, self.store.tensor, self.holder.authorize, host=cfg.ucx_host,
                                   port=cfg.ucx_port, name=cfg.holder_id, pin=self.store.hold, limits=cfg.slot_limits())
        await self.holder.start(self._server)
        self._tasks = [asyncio.create_task(self.holder.heartbeat()),
                       asyncio.create_task(self.bus.config_board().watch(self._on_config, self._on_withdrawn))]
        log.info("holder_started", holder_id=cfg.holder_id, transport=self.holder.transport, models=sorted(self._sha))

    async def _on_config(self, cfg: schemas.RecomputeConfig) -> None:
        self.holder.on_config(cfg)  # readers paired, and the E layers its plans start at

    async def _on_withdrawn(self, cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
        """A config was deleted: only the pairs `left` declares keep their readers (the withdrawn
        pair's receivers are refused their next grant) and their E layers."""
        grants.unpair_withdrawn(self.holder, left)

    def hold(self, model_id: str, prompt: Sequence[int], read: Callable[[], list[KV]]) -> bool:
        """Hold `prompt` as `model_id` computed it: `read()` (called here, on the engine's thread,
        while its blocks are still the prompt's) copies every layer's K/V out of the engine's
        cache, each [1, kv_heads, T, head_dim]; the rest runs off the step. False, and nothing
        read, while `MAX_PENDING` holds wait already: copies would pile up faster than E is
        computed beside an engine prefilling at full speed."""
        if not self._pending.acquire(blocking=False):
            log.info("hold_skipped", model=model_id, tokens=len(prompt), reason=f"busy: {MAX_PENDING} holds pending")
            return False
        try:
            kv = read()
        except BaseException:
            self._pending.release()
            raise
        asyncio.run_coroutine_threadsafe(self._hold(model_id, list(prompt), kv), self.loop)
        return True

    async def _hold(self, model_id: str, prompt: list[int], kv: list[KV]) -> None:
        try:
            await self._capture_and_put(model_id, prompt, kv)
        finally:
            self._pending.release()

    async def _capture_and_put(self, model_id: str, prompt: list[int], kv: list[KV]) -> None:
        began, scope = time.perf_counter(), self.cfg.scope
        cid = held_context_id(prompt, scope, self._sha[model_id])
        if len(prompt) < 2 or self.store.get(cid) is not None:
            return
        held = self.holder.models[model_id]

        def capture() -> Any:  # off the loop: the first call loads DroidMesh's copy of the weights
            with self._models.using(model_id) as model:  # E: no other computation on these weights meanwhile
                captured = captured_from_engine(model, prompt, kv, held.e_layers(self.cfg.hold_e_layers, model.num_layers))
            placed = captured.with_items(self.holder.place(captured.items()))
            return dataclasses.replace(placed, scope=scope, model_name=model_id)

        try:
            captured = await self.loop.run_in_executor(self._compute, capture)
            await self.holder.put(cid, captured)
        except DroidMeshError as e:  # over the budget, pinned by pulls, or shapes refused: not held
            log.info("hold_skipped", context_id=cid, tokens=len(prompt), reason=f"{e.code}: {e}")
            return
        except Exception:  # a bug costs this context, never the engine
            log.exception("hold_failed", context_id=cid, tokens=len(prompt))
            return
        log.info("held", context_id=cid, model=model_id, tokens=len(prompt), nbytes=captured.nbytes,
                 e_layers=sorted(captured.e), ms=round((time.perf_counter() - began) * 1e3, 1))

    async def stop(self) -> None:
        """Withdraw what is held, then stop serving it."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.holder.withdraw()
        if self._server is not None:
            await self._server.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
