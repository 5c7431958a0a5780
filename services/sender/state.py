"""What the sender's handlers share (`SenderState`), apart from the service that builds it
(`service.py`), so handlers never import the service."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.grants import Readers
from droidmesh.services.sender.store import CacheStore
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire.schemas import Transport


class SenderState:
    """What the handlers share: config, model (and its weights' sha256), store, bus, where the bulk
    server listens, and the torch worker thread."""

    def __init__(self, cfg: SenderConfig, bus: Bus, model: ModelAdapter, model_sha256: str,
                 run_torch: Callable[..., Awaitable[Any]], metrics: Metrics):
        self.cfg, self.bus, self.model, self._torch, self.metrics = cfg, bus, model, run_torch, metrics
        self.model_sha256 = model_sha256
        self.eos_token_id = model.tokenizer.eos_token_id if model.tokenizer is not None else None
        self.store = CacheStore(cfg.store_bytes, cfg.pull_bytes)
        metrics.store_bytes.set_function(lambda: self.store.resident_bytes)  # pulls' pinned tensors and copies too
        metrics.store_contexts.set_function(lambda: len(self.store.ids()))
        self.bulk_transport: Transport = "ucx"  # set once the bulk server listens
        self.bulk_address = ""
        # the bulk server's `place`: a context's tensors where its channel serves them from
        self.place: Callable[[list[torch.Tensor]], list[torch.Tensor]] = list
        self.profiled_e_layers: dict[str, set[int]] = {}  # receiver model -> group starts it may use
        self.tokens = TokenIssuer(cfg.grant_ttl_s)
        self.readers = Readers(cfg.model_id, cfg.readers)  # receiver models granted pulls (grants.py)

    def e_layers(self) -> list[int]:
        """Configured E layers plus every group start a profiled receiver may choose online."""
        return sorted(set(self.cfg.e_layers).union(*self.profiled_e_layers.values()))

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        """Run torch work on the service's single worker thread (never on the event loop)."""
        return await self._torch(fn, *args)
