"""The recompute-config board: profilers publish per-pair configs, receivers and senders watch.

`ConfigBoard` (coroutines on the caller's loop):
  - `put(config)`        profiler: publish a pair's config under (sender, receiver, version)
  - `watch(on_config)`   receivers / senders: every current config, then each new one, until
                         cancelled; `on_config` runs on the loop and must not block
Backed by a JetStream key-value bucket, so configs survive restarts and late joiners see them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("configs")
OnConfig = Callable[[schemas.RecomputeConfig], Awaitable[None]]


def config_key(cfg: schemas.RecomputeConfig) -> str:
    return f"{subjects.config_key(cfg.sender_model, cfg.receiver_model)}.v{cfg.profile_version}"


class ConfigBoard(Protocol):
    async def put(self, config: schemas.RecomputeConfig) -> None: ...

    async def watch(self, on_config: OnConfig) -> None: ...


class NatsConfigBoard:
    def __init__(self, nc: Any, retry_s: float = 2.0):
        self._nc = nc
        self._retry_s = retry_s
        self._kv: Any = None

    async def _bucket(self, create: bool) -> Any:
        if self._kv is None:
            js = self._nc.jetstream()
            if create:
                self._kv = await js.create_key_value(bucket=subjects.CONFIG_BUCKET, history=5)
            else:
                self._kv = await js.key_value(subjects.CONFIG_BUCKET)
        return self._kv

    async def put(self, config: schemas.RecomputeConfig) -> None:
        await (await self._bucket(create=True)).put(config_key(config), schemas.encode(config))

    async def _open_for_watch(self) -> Any:
        """The bucket, once it exists: readers may lack the permission to create it (under
        role permissions only profilers and admins can), so they wait for it to appear."""
        while True:
            try:
                return await self._bucket(create=False)
            except Exception as e:  # bucket not there yet (or JetStream briefly unavailable)
                try:
                    return await self._bucket(create=True)
                except Exception:
                    log.info("config_bucket_unavailable", error=repr(e), retry_s=self._retry_s)
                    await asyncio.sleep(self._retry_s)

    async def watch(self, on_config: OnConfig) -> None:
        """Follow the bucket forever; a broken watcher (server restart) is re-opened and
        replays the current configs (handlers keep the newest version, so replays are harmless)."""
        while True:
            try:
                await self._watch_once(on_config)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("config_watch_restarting", error=repr(e))
                self._kv = None
                await asyncio.sleep(self._retry_s)

    async def _watch_once(self, on_config: OnConfig) -> None:
        watcher = await (await self._open_for_watch()).watchall()
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
