"""Gateway service: an OpenAI-compatible HTTP API (`handlers.py`) in front of the receivers.

The HTTP server is aiohttp's, run on the service's own asyncio loop beside nats-py: no ASGI
server and no second loop or thread, so a handler awaits the mesh client directly and the
runtime's lifecycle (signals, health, drain) covers the API as it does every other service.
The API listens on `http_host:http_port`; /livez /readyz /metrics stay on the metrics port.

Start: listen (port 0: any free one, logged in `gateway_started`) -> join the mesh in the
background. The port answers before NATS does: until the gateway's connection is up (nats-py
retries every 0.5 s, forever) every request that needs the mesh is a one-line 503, never a
refused connection; `gateway_mesh_joined` is logged once it is up.
The API listens through `guard.py` (its own accept loop, the connection cap) with aiohttp's
keep-alive timeout set to `header_timeout_s` (the head deadline, see `guard.py`).
Keys: the key file is checked every `keys_reload_s` and read again when it changed (`KeyFile`).
Quotas: until NATS is up each key's limits are this process's alone; once it is, its rates are
shared with the other replicas through a JetStream bucket (`shared.auth.shared_quota`), and the
slices this copy took are given back every half `quota_lease_s` (and all of them at stop).
Stop: not ready -> `withdraw()` stops listening and lets requests in flight finish (up to
`shutdown_grace_s`) while the bus is still open, gives its quota slices back -> the bus drains.
The gateway imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from aiohttp import web

from droidmesh.services.gateway import handlers
from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.guard import ConnectionGuard, GuardedSite, connection_cap
from droidmesh.services.gateway.state import NOT_CONNECTED, GatewayState, Mesh
from droidmesh.shared.auth import keys as api_keys
from droidmesh.shared.auth.quota_nats import NatsQuotaStore
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.runtime import ServiceRuntime

log = structlog.get_logger("gateway")
GIVE_BACK_S = 5.0  # at stop, how long giving quota slices back may take (NATS slow or away)
LINGER_S = 1.0  # aiohttp's default (10 s) would let a refused body trickle on that long


class GatewayService(ServiceRuntime[GatewayConfig]):
    nats_name = "droidmesh-gateway"

    def __init__(self, cfg: GatewayConfig, bus: Bus | None = None, client: Mesh | None = None):
        super().__init__("gateway", cfg, bus)
        self._client = client  # tests: a fake mesh
        self.state: GatewayState | None = None
        self.http_port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        cfg = self.cfg
        cap = connection_cap(cfg.max_connections)
        self.state = state = GatewayState(cfg, NOT_CONNECTED, self.metrics, mesh_up=lambda: False,
                                          guard=ConnectionGuard(cap))
        self.phase = "listening"
        # access_log off: the middleware writes one canonical line per request instead. The
        # keep-alive timeout also bounds a connection that never completes a request head;
        # lingering: how long a refused request's unread body may still be drained.
        self._runner = web.AppRunner(handlers.make_app(state), access_log=None, shutdown_timeout=cfg.shutdown_grace_s,
                                     keepalive_timeout=cfg.header_timeout_s, lingering_time=LINGER_S)
        await self._runner.setup()
        await GuardedSite(self._runner, cfg.http_host, cfg.http_port, state.guard).start()
        self.http_port = self._runner.addresses[0][1]
        log.info("gateway_started", gateway_id=cfg.gateway_id, http_host=cfg.http_host, http_port=self.http_port,
                 max_body_bytes=cfg.max_body_bytes, max_tokens_limit=cfg.max_tokens_limit, max_connections=cap,
                 header_timeout_s=cfg.header_timeout_s, body_timeout_s=cfg.body_timeout_s,
                 max_inflight_per_client=cfg.max_inflight_per_client, max_inflight_per_peer=cfg.max_inflight_per_peer,
                 api_keys=len(state.keys.keys) if state.keys is not None else None)
        if cfg.api_keys and not api_keys.has_scope_secret(cfg.api_keys):
            log.warning("key_file_without_scope_secret", effect="a tenant's cache scope is its name: a direct mesh "
                        "client that knows the name can reuse and time its contexts; make a new file with `keys add`")
        if state.key_file is not None and cfg.keys_reload_s > 0:
            self.tasks.supervise("key-file", self._watch_keys)
        if self._given_bus is not None:  # in-process wiring (tests): the mesh is there already
            await self._join_mesh()
        else:
            self.tasks.spawn(self._join_mesh(), "join-mesh")

    async def _join_mesh(self) -> None:
        """Connect (the runtime's `connect`, retried until NATS answers), then serve through it."""
        bus = await self.connect()
        nc: Any = getattr(bus, "nc", None)  # a NatsBus: requests fail fast (503) while it reconnects
        assert self.state is not None  # set before this runs
        self.state.client = self._client or MeshClient(bus)
        self.state.mesh_up = (lambda: nc.is_connected) if nc is not None else (lambda: True)
        if nc is not None and self.state.keys is not None:
            self.state.quotas.attach(NatsQuotaStore(nc, self.cfg.quota_timeout_s))
            self.tasks.supervise("quota-slices", self._give_back_slices)
        if self._started:
            self.phase = "serving"  # `connect` named its own phase meanwhile
        log.info("gateway_mesh_joined")

    async def _watch_keys(self) -> None:
        state = self.state
        assert state is not None and state.key_file is not None
        while True:
            await asyncio.sleep(self.cfg.keys_reload_s)
            keys = await asyncio.to_thread(state.key_file.poll)  # a changed file is read and checked off the loop
            if keys is not None:
                state.use_keys(keys)

    async def _give_back_slices(self) -> None:
        assert self.state is not None
        while True:
            await asyncio.sleep(self.cfg.quota_lease_s / 2)
            await self.state.quotas.expire()

    async def withdraw(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stop listening, finish requests in flight (they need the bus)
            self._runner = None
        if self.state is not None:  # what this copy took of its keys' shared rates is the others' again
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GIVE_BACK_S):
                    await self.state.quotas.expire(force=True)
