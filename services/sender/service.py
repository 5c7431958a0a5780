"""Sender service: hosts one model, prefills contexts, serves their KV/E over its bulk channel.

Start: load the model (worker thread) -> connect -> start the bulk server (UCX: ephemeral port by
default) -> serve generate/prefill requests and pull grants (to readers of this model only:
`shared/holding`) -> heart-beat and follow the config board, pairs declared and withdrawn (both
supervised: a crashed loop is restarted, the sender not ready until it is). Stop: withdraw every
cache (eviction events) while the bus is open, drain the bus, close the bulk server.
"""

from __future__ import annotations

import functools

import structlog

from droidmesh.services.sender import handlers
from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.state import SenderState
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.runtime import ServiceRuntime
from droidmesh.shared.service.wrappers import rpc
from droidmesh.shared.transport.bulk import BulkServer, make_server
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest

log = structlog.get_logger("sender")


class SenderService(ServiceRuntime[SenderConfig]):
    nats_name = "droidmesh-sender"

    def __init__(self, cfg: SenderConfig, bus: Bus | None = None, model: ModelAdapter | None = None,
                 board: ConfigBoard | None = None):
        super().__init__("sender", cfg, bus)
        self._model, self._board = model, board
        self._server: BulkServer | None = None
        self.state: SenderState | None = None

    async def start(self) -> None:
        cfg = self.cfg
        model, sha256 = await self.host_model(self._model, cfg.model_path, device=cfg.device, dtype=cfg.dtype,
                                              name=cfg.model_id)
        bus = await self.connect()
        s = self.state = SenderState(cfg, bus, model, sha256, self.run_torch, self.metrics)
        self._server = make_server(cfg.transport, s.store.tensor, s.holder.authorize, host=cfg.ucx_host,
                                   port=cfg.ucx_port, name=cfg.sender_id, pin=s.store.hold, limits=cfg.slot_limits())
        await s.holder.start(self._server)
        await bus.serve(subjects.sender_generate(cfg.model_id),
                        rpc(GenerateRequest, functools.partial(handlers.generate, s)), queue="senders")
        await bus.serve(subjects.sender_prefill(cfg.model_id),
                        rpc(schemas.PrefillRequest, functools.partial(handlers.prefill, s)), queue="senders")
        self.tasks.supervise("heartbeat", s.holder.heartbeat)
        board = self._board or bus.config_board()
        self.tasks.supervise("config-watch", lambda: board.watch(functools.partial(handlers.on_config, s),
                                                                 functools.partial(handlers.on_withdrawn, s)))
        log.info("sender_started", model_id=cfg.model_id, sender_id=cfg.sender_id, transport=s.holder.transport,
                 address=s.holder.address,
                 fingerprint=model.fingerprint.id, layers=model.num_layers)

    async def withdraw(self) -> None:
        if self.state is not None:
            await self.state.holder.withdraw()

    async def release(self) -> None:
        if self._server is not None:
            await self._server.close()
