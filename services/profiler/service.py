"""Profiler service: profile requests on a queue group (copies share the work); results go to
the recompute-config board that receivers and senders watch. Models are loaded per request, in
the worker thread, so the profiler is ready as soon as it is connected.

Operators ask on `PROFILER_PROFILE`; the receivers of each model id in `models` on that model's
own `profiler_reprofile` subject, which only their NATS user (and operators) may publish on: the
subject a request came in on decides what it may ask (`checks`) and which limits it counts
against (`admission`); its NATS user whether a re-profile is published (operators only). The
profiler watches the board for each pair's newest config (the version it must outrank, the relay
buckets a re-profile keeps), and for withdrawn ones."""

from __future__ import annotations

import functools

import structlog

from droidmesh.services.profiler import handlers
from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.services.profiler.state import ProfilerState
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.model.names import Pair
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
        watched = self._board or bus.config_board()  # its own handle: a watch restarting drops its bucket

        async def seen(cfg: schemas.RecomputeConfig) -> None:
            state.keep(cfg)
            log.info("config_seen", pair=Pair(cfg.sender_model, cfg.receiver_model).versioned(cfg.profile_version))

        async def withdrawn(cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
            state.forget(cfg, left)
            log.info("config_withdrawn", pair=Pair(cfg.sender_model, cfg.receiver_model).versioned(cfg.profile_version))

        self.tasks.supervise("config_watch", lambda: watched.watch(seen, withdrawn))
        await bus.serve(subjects.PROFILER_PROFILE, rpc(schemas.ProfileRequest, functools.partial(handlers.profile, state)),
                        queue=subjects.PROFILER_QUEUE)
        for model_id in self.cfg.model_paths():
            await bus.serve(subjects.profiler_reprofile(model_id),
                            rpc(schemas.ProfileRequest, functools.partial(handlers.reprofile, state, model_id)),
                            queue=subjects.PROFILER_QUEUE)
        log.info("profiler_started", reprofile_models=sorted(self.cfg.model_paths()), data_root=bool(self.cfg.data_root))
