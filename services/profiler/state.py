"""What the profiler's handlers share (`ProfilerState`), apart from the service that builds it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from droidmesh.services.profiler.admission import Admission
from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.mesh.maps_store import MapsStore
from droidmesh.shared.wire import schemas


class ProfilerState:
    """Config, the config board and maps store results go to, the torch worker thread, the queue
    (`admission`), and the newest config of each pair seen on the board or published here."""

    def __init__(self, cfg: ProfilerConfig, board: ConfigBoard, maps: MapsStore,
                 run_torch: Callable[..., Awaitable[Any]]):
        self.cfg, self.board, self.maps, self._torch = cfg, board, maps, run_torch
        self.admission = Admission(cfg.queue_size, cfg.per_receiver)
        self._newest: dict[tuple[str, str], schemas.RecomputeConfig] = {}

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        """Run torch work on the service's single worker thread (never on the event loop)."""
        return await self._torch(fn, *args)

    def keep(self, cfg: schemas.RecomputeConfig) -> None:
        """A config on the board (its watch hands over only those watchers would take) or published here."""
        key = (cfg.sender_model, cfg.receiver_model)
        if key not in self._newest or cfg.profile_version > self._newest[key].profile_version:
            self._newest[key] = cfg

    def forget(self, cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
        """`cfg` was withdrawn from the board (`left`: those still on it): the pair's newest is the
        newest left, or none (then only an operator's profile may declare the pair again)."""
        key = (cfg.sender_model, cfg.receiver_model)
        current = self._newest.get(key)
        if current is None or current.profile_version != cfg.profile_version:
            return
        del self._newest[key]
        for c in left:
            if (c.sender_model, c.receiver_model) == key:
                self.keep(c)

    def newest(self, sender_model: str, receiver_model: str) -> schemas.RecomputeConfig | None:
        return self._newest.get((sender_model, receiver_model))
