"""What the profiler's handlers share (`ProfilerState`), apart from the service that builds it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.mesh.maps_store import MapsStore


class ProfilerState:
    """Config, the config board and maps store results go to, and the torch worker thread."""

    def __init__(self, cfg: ProfilerConfig, board: ConfigBoard, maps: MapsStore,
                 run_torch: Callable[..., Awaitable[Any]]):
        self.cfg, self.board, self.maps, self._torch = cfg, board, maps, run_torch

    async def run_torch(self, fn: Any, *args: Any) -> Any:
        """Run torch work on the service's single worker thread (never on the event loop)."""
        return await self._torch(fn, *args)
