"""What the gateway's handlers share (`GatewayState`): config, the mesh client, metrics, the
receiver models discovered and the admission state (connections, per-client limits), apart from
the service that builds it (`service.py`). Until the service has joined the mesh, `client` is
`NOT_CONNECTED` and `mesh_up()` is false: every request that needs the mesh is a 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from droidmesh.services.gateway import openai
from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.fairness import ClientLimits
from droidmesh.services.gateway.guard import ConnectionGuard
from droidmesh.shared.auth import keys as api_keys
from droidmesh.shared.auth.quota import Quotas
from droidmesh.shared.auth.shared_quota import SharedQuotas
from droidmesh.shared.mesh import discovery
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateChunk, Sampling

MAX_REMEMBERED_MODELS = 4096  # ids ever seen (404 vs 503); bounded against a peer inventing names


class Mesh(Protocol):
    """The part of `shared/mesh/client.MeshClient` the gateway uses (tests pass a fake)."""

    async def ask(self, receiver: str, context: str, question: str, *, max_new_tokens: int = ...,
                  mode: schemas.Mode = ..., timeout: float = ..., request_id: str | None = ...,
                  sampling: Sampling | None = ..., chat: list[schemas.ChatMessage] | None = ...,
                  scope: str = ..., n: int = ...) -> schemas.GenerateReply: ...

    def stream(self, receiver: str, context: str, question: str, *, max_new_tokens: int = ...,
               mode: schemas.Mode = ..., timeout: float = ..., request_id: str | None = ...,
               sampling: Sampling | None = ..., chat: list[schemas.ChatMessage] | None = ...,
               scope: str = ...) -> AsyncIterator[GenerateChunk | schemas.GenerateReply]: ...

    async def receivers(self, window_s: float = ...) -> list[discovery.ReceiverModel]: ...


class _NotConnected:
    """The mesh before the gateway has joined it: never reached (`mesh_up()` is false), but a
    request that got past the check meanwhile fails as the mesh being unavailable."""

    def _down(self) -> openai.MeshUnavailableError:
        return openai.MeshUnavailableError("the mesh's control plane (NATS) is not connected yet")

    async def ask(self, *args: object, **kwargs: object) -> schemas.GenerateReply:
        raise self._down()

    async def stream(self, *args: object, **kwargs: object) -> AsyncIterator[GenerateChunk | schemas.GenerateReply]:
        raise self._down()
        yield  # an async generator, as MeshClient.stream is

    async def receivers(self, window_s: float = 0.5) -> list[discovery.ReceiverModel]:
        raise self._down()


NOT_CONNECTED: Mesh = _NotConnected()


class GatewayState:
    def __init__(self, cfg: GatewayConfig, client: Mesh, metrics: Metrics, mesh_up: Callable[[], bool] = lambda: True,
                 guard: ConnectionGuard | None = None, keys: api_keys.KeyRing | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.cfg, self.client, self.metrics, self.mesh_up = cfg, client, metrics, mesh_up
        # the key file, re-read when it changes (`reload_keys`); None when the keys were given (tests) or there are none
        self.key_file = api_keys.KeyFile(cfg.api_keys) if keys is None and cfg.api_keys else None
        # None: no key file, so no authentication (the config allows that on loopback only)
        self.keys = keys if self.key_file is None else api_keys.KeyRing(self.key_file.keys)
        # Local limits until the service attaches the shared buckets (NATS); see shared_quota.py.
        self.quotas = SharedQuotas(Quotas(clock), clock=clock, wall=wall, lease_fraction=cfg.quota_lease_fraction,
                                   lease_s=cfg.quota_lease_s, timeout_s=cfg.quota_timeout_s)
        self.limits = openai.Limits(cfg.default_max_tokens, cfg.max_tokens_limit)
        self.guard = guard or ConnectionGuard(cfg.max_connections)  # the service's, when it listens through one
        self.clients = ClientLimits(cfg.max_inflight_per_client, cfg.max_inflight_per_peer)
        self.first_seen: dict[str, int] = {}  # model id -> unix time first discovered ("created")
        self._models: list[discovery.ReceiverModel] = []
        self._seen: dict[str, tuple[discovery.ReceiverModel, float]] = {}  # model id -> (as last found, when)
        self._fetched: float | None = None  # monotonic time of the last discovery
        self._lock = asyncio.Lock()  # one discovery at a time; requests arriving meanwhile share it

    def reload_keys(self) -> bool:
        """Switch to the key file's keys if it changed and loads (a removed key is refused from the
        next request on); whether it switched."""
        if self.key_file is None or self.keys is None:
            return False
        keys = self.key_file.poll()
        if keys is not None:
            self.use_keys(keys)
        return keys is not None

    def use_keys(self, keys: dict[str, api_keys.ApiKey]) -> None:
        """Authenticate with `keys` from the next request on, and drop what removed keys left."""
        if self.keys is not None:
            self.keys.keys = keys
            self.quotas.forget(set(keys))

    async def models(self, again: bool = False) -> list[discovery.ReceiverModel]:
        """Receiver models up now: a discovery at most every `models_ttl_s` (each one blocks for
        `discovery_window_s`), shared by every request that needs it meanwhile, and the models one
        found within `models_keep_s` (`_keep`). `again`: a fresh one, collecting for `miss_window_s`,
        unless the last is under a window old (a request naming a model the last one missed)."""
        if not self.mesh_up():
            raise openai.MeshUnavailableError("the mesh's control plane (NATS) is unreachable")
        if self._fresh(again):
            return self._models
        async with self._lock:
            if not self._fresh(again):
                try:
                    found = await self.client.receivers(self.cfg.miss_window_s if again else self.cfg.discovery_window_s)
                    if not found and not again and not self._seen:  # none answered in time, none known yet
                        found = await self.client.receivers(self.cfg.miss_window_s)
                except Exception as e:  # NATS lost meanwhile, a flush timing out: the mesh is unavailable
                    raise openai.MeshUnavailableError(f"receiver discovery failed: {type(e).__name__}") from e
                self._models, self._fetched = self._keep(found), time.monotonic()
                now = int(time.time())
                for m in found:
                    if len(self.first_seen) < MAX_REMEMBERED_MODELS:
                        self.first_seen.setdefault(m.model_id, now)
        return self._models

    def _keep(self, found: list[discovery.ReceiverModel]) -> list[discovery.ReceiverModel]:
        """`found`, and the models a discovery found within `models_keep_s` that this one missed
        (their receivers were too busy to answer within the window), as last found."""
        now = time.monotonic()
        for m in found:
            if m.model_id in self._seen or len(self._seen) < MAX_REMEMBERED_MODELS:
                self._seen[m.model_id] = (m, now)
        self._seen = {k: (m, t) for k, (m, t) in self._seen.items() if now - t < self.cfg.models_keep_s}
        ids = {m.model_id for m in found}
        return found + sorted((m for m, _ in self._seen.values() if m.model_id not in ids), key=lambda m: m.model_id)

    def _fresh(self, again: bool = False) -> bool:
        age = self.cfg.discovery_window_s if again else self.cfg.models_ttl_s
        return self._fetched is not None and time.monotonic() - self._fetched < age

    async def check_model(self, model: str) -> None:
        """404 for a model never discovered; 503 for one seen before that has no receiver up now.
        A model the cached discovery lacks gets one fresh discovery first: a receiver busy when
        the last one asked (a window of `discovery_window_s`) is not thereby gone."""
        if any(m.model_id == model for m in await self.models()):
            return
        if any(m.model_id == model for m in await self.models(again=True)):
            return
        if model in self.first_seen:
            raise openai.MeshUnavailableError(f"no receiver of model {model!r} is up", param="model")
        raise openai.ModelNotFoundError(f"the model {model!r} does not exist (GET /v1/models lists them)", param="model")

    def model_rows(self, models: list[discovery.ReceiverModel]) -> list[tuple[str, int, int]]:
        return [(m.model_id, self.first_seen.get(m.model_id, 0), len(m.instances)) for m in models]
