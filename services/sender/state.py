"""What the sender's handlers share (`SenderState`), apart from the service that builds it
(`service.py`), so handlers never import the service."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from droidmesh.services.sender.config import SenderConfig
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.batching import DEFAULT_MAX_BATCH, DecodeBatcher
from droidmesh.shared.service.metrics import Metrics


class SenderState:
    """What the handlers share: config, model (and its weights' sha256), bus, the holder (store,
    grants, announcements: `shared.holding`) and the torch worker thread."""

    def __init__(self, cfg: SenderConfig, bus: Bus, model: ModelAdapter, model_sha256: str,
                 run_torch: Callable[..., Awaitable[Any]], metrics: Metrics):
        self.cfg, self.bus, self.model, self._torch, self.metrics = cfg, bus, model, run_torch, metrics
        self.model_sha256 = model_sha256
        self.eos_token_id = model.tokenizer.eos_token_id if model.tokenizer is not None else None
        self.holder = Holder(cfg.sender_id, bus, CacheStore(cfg.store_bytes, cfg.pull_bytes, cfg.device_store_bytes), metrics,
                             grant_ttl_s=cfg.grant_ttl_s, heartbeat_s=cfg.heartbeat_s, authenticated=bool(cfg.nats_user))
        self.held = self.holder.add_model(cfg.model_id, model_sha256, model.dtype, cfg.readers)
        self.store = self.holder.store
        # its own answers' decode steps run together (continuous batching, as a receiver's)
        self.batcher = DecodeBatcher(model, run_torch, DEFAULT_MAX_BATCH)

    def e_layers(self) -> list[int]:
        """Configured E layers plus every group start a profiled receiver may choose online."""
        return self.held.e_layers(self.cfg.e_layers, self.model.num_layers)

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        """Run torch work on the service's single worker thread (never on the event loop)."""
        return await self._torch(fn, *args)
