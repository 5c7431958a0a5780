"""Profiler service: profile requests on a queue group (copies share the work); results go to
the recompute-config board that receivers and senders watch. Models are loaded per request, in
the worker thread, so the profiler is ready as soon as it is connected."""

from __future__ import annotations

import functools

import structlog
from droidmesh.services.profiler import handlers
from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.services.profiler.state import ProfilerState
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.service.runtime import ServiceRuntime
from droidmesh.shared.service.wrappers import rpc
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("profiler")


class ProfilerService(ServiceRuntime[ProfilerConfig]):
    nats_name = "droidmesh-profiler"

    def __init__(self, cfg: ProfilerConfig, bus: Bus | None = None, board: ConfigBoard | None = None):
        super().__init__("profiler", cfg, bus)
        self._board = board

    async def start(self) -> None:
        bus = await self.connect()
        state = ProfilerState(self.cfg, self._board or bus.config_board(), bus.maps_store(), self.run_torch)
        await bus.serve(subjects.PROFILER_PROFILE, rpc(schemas.ProfileRequest, functools.partial(handlers.profile, state)),
                        queue=subjects.PROFILER_QUEUE)
        log.info("profiler_started")
