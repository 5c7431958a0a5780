"""Gateway service: an OpenAI-compatible HTTP API (`handlers.py`) in front of the receivers.

The HTTP server is aiohttp's, run on the service's own asyncio loop beside nats-py: no ASGI
server and no second loop or thread, so a handler awaits the mesh client directly and the
runtime's lifecycle (signals, health, drain) covers the API as it does every other service.
The API listens on `http_host:http_port`; /livez /readyz /metrics stay on the metrics port.

Start: connect -> the mesh client -> listen (port 0: any free one, logged in `gateway_started`).
Stop: not ready -> `withdraw()` stops listening and lets requests in flight finish (up to
`shutdown_grace_s`) while the bus is still open -> the bus drains. The gateway imports no torch.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web
from droidmesh.services.gateway import handlers
from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.state import GatewayState, Mesh
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.runtime import ServiceRuntime

log = structlog.get_logger("gateway")


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
        bus = await self.connect()
        nc: Any = getattr(bus, "nc", None)  # a NatsBus: requests fail fast (503) while it reconnects
        self.state = GatewayState(cfg, self._client or MeshClient(bus), self.metrics,
                                  mesh_up=(lambda: nc.is_connected) if nc is not None else (lambda: True))
        self.phase = "listening"
        # access_log off: the middleware writes one canonical line per request instead.
        self._runner = web.AppRunner(handlers.make_app(self.state), access_log=None, shutdown_timeout=cfg.shutdown_grace_s)
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.http_host, cfg.http_port).start()
        self.http_port = self._runner.addresses[0][1]
        log.info("gateway_started", gateway_id=cfg.gateway_id, http_host=cfg.http_host, http_port=self.http_port,
                 max_body_bytes=cfg.max_body_bytes, max_tokens_limit=cfg.max_tokens_limit)

    async def withdraw(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stop listening, finish requests in flight (they need the bus)
            self._runner = None
