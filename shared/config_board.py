"""The recompute-config board: profilers publish per-pair configs, receivers and senders watch.

`ConfigBoard` (coroutines on the caller's loop):
  - `put(config)`        profiler: publish a pair's config under (sender, receiver, version)
  - `watch(on_config)`   receivers / senders: every current config, then each new one, until
                         cancelled; `on_config` runs on the loop and must not block
Backed by a JetStream key-value bucket, so configs survive restarts and late joiners see them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from shared.errors import DroidMeshError
from shared.wire import schemas, subjects

log = structlog.get_logger("configs")
OnConfig = Callable[[schemas.RecomputeConfig], Awaitable[None]]


def config_key(cfg: schemas.RecomputeConfig) -> str:
    return f"{subjects.config_key(cfg.sender_model, cfg.receiver_model)}.v{cfg.profile_version}"


class ConfigBoard(Protocol):
    async def put(self, config: schemas.RecomputeConfig) -> None: ...

    async def watch(self, on_config: OnConfig) -> None: ...


class NatsConfigBoard:
    def __init__(self, nc: Any):
        self._nc = nc
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            js = self._nc.jetstream()
            self._kv = await js.create_key_value(bucket=subjects.CONFIG_BUCKET, history=5)
        return self._kv

    async def put(self, config: schemas.RecomputeConfig) -> None:
        await (await self._bucket()).put(config_key(config), schemas.encode(config))

    async def watch(self, on_config: OnConfig) -> None:
        watcher = await (await self._bucket()).watchall()
        try:
            async for entry in watcher:
                if entry is None or not entry.value:  # end of the initial replay, or a delete
                    continue
                try:
                    cfg = schemas.decode(entry.value, schemas.RecomputeConfig)
                except DroidMeshError as e:
                    log.warning("bad_config_entry", key=entry.key, error=str(e))
                    continue
                await on_config(cfg)
        finally:
            await watcher.stop()


class InMemoryConfigBoard:
    """In-process twin for tests: `watch` replays what was put, then follows new puts."""

    def __init__(self) -> None:
        import asyncio

        self._configs: dict[str, schemas.RecomputeConfig] = {}
        self._new = asyncio.Condition()

    async def put(self, config: schemas.RecomputeConfig) -> None:
        async with self._new:
            self._configs[config_key(config)] = config
            self._new.notify_all()

    async def watch(self, on_config: OnConfig) -> None:
        seen: set[str] = set()
        while True:
            async with self._new:
                fresh = [(k, c) for k, c in self._configs.items() if k not in seen]
                if not fresh:
                    await self._new.wait()
                    continue
            for key, cfg in fresh:
                seen.add(key)
                await on_config(cfg)
