"""Receiver service: generate requests on the model's queue group (copies share the load),
senders' endpoint events to warm bulk-channel connections, recompute configs per sender model.

Start: load the model (worker thread) -> connect -> load the translators it names (files, or the
maps bucket; a refused one is logged and kept as a reason) -> follow the config board (supervised) ->
subscribe availability events -> serve generate requests. Stop: drain the bus (requests already
taken are answered, siblings get new ones), then close the bulk client those requests pulled with.
"""

from __future__ import annotations

import functools

import structlog

from droidmesh.services.receiver import handlers, pipeline
from droidmesh.services.receiver.answer_stream import ListenerWatch
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.pipeline import load_translators
from droidmesh.services.receiver.state import ReceiverState
from droidmesh.shared.mesh import discovery
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.runtime import ServiceRuntime
from droidmesh.shared.service.wrappers import event, rpc
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("receiver")


class ReceiverService(ServiceRuntime[ReceiverConfig]):
    nats_name = discovery.RECEIVER_SERVICE

    def __init__(self, cfg: ReceiverConfig, bus: Bus | None = None, model: ModelAdapter | None = None,
                 board: ConfigBoard | None = None):
        super().__init__("receiver", cfg, bus)
        self._model, self._board = model, board
        self.state: ReceiverState | None = None

    async def start(self) -> None:
        cfg = self.cfg
        model, sha256 = await self.host_model(self._model, cfg.model_path, device=cfg.device, dtype=cfg.dtype,
                                              name=cfg.model_id)
        bus = await self.connect()
        s = self.state = ReceiverState(cfg, bus, model, sha256, self.run_torch, self.tasks, self.metrics)
        s.listeners = await ListenerWatch.open(bus)  # streams whose client left stop decoding
        s.translations, s.translator_failures = await load_translators(cfg.translators, bus.maps_store(), model, sha256,
                                                                       cfg.lookup_timeout_s * 20)
        for why in s.translator_failures:
            log.warning("translator_unavailable", reason=why)
        await pipeline.screen_for(s)  # the KV screen's reference, built before the first request waits on it
        board = self._board or bus.config_board()
        self.tasks.supervise("config-watch", lambda: board.watch(functools.partial(handlers.on_config, s)))
        await bus.subscribe(subjects.SENDER_ENDPOINT_ALL, event(schemas.SenderEndpoint, functools.partial(handlers.on_endpoint, s)))
        await bus.serve(subjects.receiver_generate(cfg.model_id),
                        rpc(schemas.GenerateRequest, functools.partial(handlers.generate, s)),
                        queue=subjects.receiver_queue(cfg.model_id), metadata={discovery.MODEL_KEY: cfg.model_id})
        log.info("receiver_started", model_id=cfg.model_id, receiver_id=cfg.receiver_id, transport=cfg.transport,
                 fingerprint=model.fingerprint.id, layers=model.num_layers)

    async def release(self) -> None:
        if self.state is not None:
            await self.state.bulk.close()
