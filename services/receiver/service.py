"""Receiver service: generate requests on the model's queue group (copies share the load),
senders' endpoint events to warm bulk-channel connections, recompute configs per sender model.

Start: load the model (worker thread) -> connect -> load the translators it names (files, or the
maps bucket; a refused one is logged and kept as a reason) -> with `hold`, become a holder (a
store, a bulk server, grants, heart-beats: `shared/holding`) -> follow the config board
(supervised) -> subscribe availability events -> serve generate requests. Stop: withdraw what it
holds, drain the bus (requests already taken are answered, siblings get new ones), then close the
bulk client those requests pulled with and the holder's bulk server.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import structlog

from droidmesh.services.receiver import handlers, pipeline
from droidmesh.services.receiver.answer_stream import ListenerWatch
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.pipeline import load_translators
from droidmesh.services.receiver.state import ReceiverState
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.mesh import discovery
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.config_board import ConfigBoard
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.graphs import LayerGraphs, cuda_capture
from droidmesh.shared.service.runtime import ServiceRuntime
from droidmesh.shared.service.wrappers import event, rpc
from droidmesh.shared.transport.bulk import BulkServer, make_client, make_server
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.channels import SenderEndpoint
from droidmesh.shared.wire.generation import GenerateRequest

log = structlog.get_logger("receiver")


class ReceiverService(ServiceRuntime[ReceiverConfig]):
    nats_name = discovery.RECEIVER_SERVICE

    def __init__(self, cfg: ReceiverConfig, bus: Bus | None = None, model: ModelAdapter | None = None,
                 board: ConfigBoard | None = None):
        super().__init__("receiver", cfg, bus)
        self._model, self._board = model, board
        self.state: ReceiverState | None = None  # the base model's (the one `model_path` names)
        self.states: dict[str, ReceiverState] = {}  # every served model's: the base's, then its adapters'
        self._server: BulkServer | None = None  # the holder's (`hold`)

    async def start(self) -> None:
        cfg = self.cfg
        hosted = await self._host_models()
        bus = await self.connect()
        listeners = await ListenerWatch.open(bus)  # streams whose client left stop decoding
        bulk = make_client(cfg.transport)  # one per process: every served model pulls over it
        for name, (model, sha256) in hosted.items():
            s = ReceiverState(self._config_of(name), bus, model, sha256, self.run_torch, self.tasks, self.metrics, bulk)
            s.listeners = listeners
            self.states[name] = s
        s = self.state = self.states[cfg.model_id]
        s.translations, s.translator_failures = await load_translators(cfg.translators, bus.maps_store(), s.model,
                                                                       s.policy_facts.model_sha256,
                                                                       cfg.lookup_timeout_s * 20)
        for why in s.translator_failures:
            log.warning("translator_unavailable", reason=why)
        for s in self.states.values():
            await pipeline.screen_for(s)  # the KV screen's reference, built before the first request waits on it
            await self._capture_graphs(s)
        if cfg.holding:
            await self._hold(bus)
        elif cfg.hold:
            log.warning("hold_off", reason="under NATS auth a receiver holds its prefills only under a holder id its "
                                           "user may announce under: set holder_id (DM_RECEIVER_HOLDER_ID) and give it "
                                           "to the roster (`droidmesh nats-auth --holder MODEL=ID`)")
        board = self._board or bus.config_board()
        self.tasks.supervise("config-watch", lambda: board.watch(self._on_config, self._on_withdrawn))
        await bus.subscribe(subjects.SENDER_ENDPOINT_ALL, event(SenderEndpoint, self._on_endpoint))
        for name, s in self.states.items():
            await bus.serve(subjects.receiver_generate(name), rpc(GenerateRequest, functools.partial(handlers.generate, s)),
                            queue=subjects.receiver_queue(name), metadata={discovery.MODEL_KEY: name})
            log.info("receiver_started", model_id=name, receiver_id=s.cfg.receiver_id, transport=cfg.transport,
                     fingerprint=s.model.fingerprint.id, layers=s.model.num_layers,
                     holder_id=cfg.holder_id if cfg.holding else None)

    async def _capture_graphs(self, s: ReceiverState) -> None:
        """Before any request: on a CUDA device (`cuda_graphs`) the short passes' layer graphs, and
        the decode pool allocated with its steps' graphs. A capture the device refuses leaves that
        part eager (logged), never the service down: graphs change speed, not answers."""
        model, pool = s.model, s.batcher.pool
        if self.cfg.cuda_graphs and model.device.type == "cuda":
            model.graphs = LayerGraphs(model, cuda_capture())
            try:
                log.info("layer_graphs", model_id=s.cfg.model_id, graphs=await self.run_torch(model.graphs.warm))
            except Exception as e:
                model.graphs = None
                log.warning("layer_graphs_failed", model_id=s.cfg.model_id, error=f"{type(e).__name__}: {e}")
        if pool is None:
            return
        try:
            graphs = await self.run_torch(pool.warm)
        except ConfigError:
            raise  # the pool does not fit in memory: the operator's setting, said at start
        except Exception as e:
            pool.capture, pool.graphs = None, {}
            log.warning("decode_pool_graphs_failed", model_id=s.cfg.model_id, error=f"{type(e).__name__}: {e}")
            graphs = await self.run_torch(pool.warm)
        log.info("decode_pool", model_id=s.cfg.model_id, slots=pool.slots, tokens=pool.tokens,
                 mib=round(pool.nbytes / 2**20), graphs=graphs)

    async def _host_models(self) -> dict[str, tuple[ModelAdapter, str]]:
        """Served model id -> (its model, its weights' sha256): the one model, or, with `adapters`,
        the base and each adapter as views over one copy of the base's weights (`AdapterSet`)."""
        cfg = self.cfg
        if not cfg.adapters:
            return {cfg.model_id: await self.host_model(self._model, cfg.model_path, device=cfg.device, dtype=cfg.dtype,
                                                        name=cfg.model_id)}
        from droidmesh.shared.model.lora import AdapterSet  # here: peft is only for adapters

        self.phase = "loading_model"
        views = await self.run_torch(functools.partial(AdapterSet.load, cfg.model_path, cfg.adapter_dirs(),
                                                       device=cfg.device, dtype=cfg.dtype, base_name=cfg.model_id))
        return {name: (view, await self.run_torch(views.sha256, name)) for name, view in views.views().items()}

    def _config_of(self, name: str) -> ReceiverConfig:
        """The settings a served model answers under: the process's, under its own ids; an
        adapter's translators are none (they are bound to the base's weights)."""
        if name == self.cfg.model_id:
            return self.cfg
        path = self.cfg.adapter_dirs()[name]
        return dataclasses.replace(self.cfg, model_path=str(path), model_id=name, receiver_id=f"{name}-{os.getpid()}",
                                   adapters=(), translators=())

    async def _on_config(self, cfg: schemas.RecomputeConfig) -> None:
        for s in self.states.values():
            await handlers.on_config(s, cfg)

    async def _on_withdrawn(self, cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
        for s in self.states.values():
            await handlers.on_withdrawn(s, cfg, left)

    async def _on_endpoint(self, ev: SenderEndpoint) -> None:
        for s in self.states.values():
            await handlers.on_endpoint(s, ev)

    async def _hold(self, bus: Bus) -> None:
        """Become a holder of what every served model prefills: one store (one budget), one bulk
        server over it, grants and heart-beats under `holder_id` (as a sender's)."""
        cfg = self.cfg
        store = CacheStore(cfg.store_bytes, cfg.pull_bytes)
        holder = Holder(cfg.holder_id, bus, store, self.metrics, grant_ttl_s=cfg.grant_ttl_s,
                        heartbeat_s=cfg.heartbeat_s, authenticated=bool(cfg.nats_user))
        for name, s in self.states.items():
            holder.add_model(name, s.policy_facts.model_sha256, s.model.dtype, cfg.readers)
            s.holder = holder
        self._server = make_server(cfg.transport, store.tensor, holder.authorize, host=cfg.ucx_host, port=cfg.ucx_port,
                                   name=cfg.holder_id, pin=store.hold, limits=cfg.slot_limits())
        await holder.start(self._server)
        self.tasks.supervise("heartbeat", holder.heartbeat)

    async def withdraw(self) -> None:
        if self.state is not None and self.state.holder is not None:
            await self.state.holder.withdraw()

    async def release(self) -> None:
        if self.state is not None:
            await self.state.bulk.close()
        if self._server is not None:
            await self._server.close()
