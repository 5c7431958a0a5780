"""The recompute-config board: profilers publish per-pair configs, receivers and senders watch.

`ConfigBoard` (coroutines on the caller's loop):
  - `put(config)`        profiler: publish a pair's config under (sender, receiver, version)
  - `watch(on_config)`   receivers / senders: every current config, then each new one, until
                         cancelled; `on_config` runs on the loop and must not block
`NatsConfigBoard.snapshot()` reads what the bucket holds now (`droidmesh config show`), and
`validate(config)` is what a config must satisfy to be published (`droidmesh config publish`).
Backed by a JetStream key-value bucket, so configs survive restarts and late joiners see them.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from droidmesh.shared.alarms import alarm
from droidmesh.shared.errors import BadRequestError, DroidMeshError
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("configs")
OnConfig = Callable[[schemas.RecomputeConfig], Awaitable[None]]


def config_key(cfg: schemas.RecomputeConfig) -> str:
    return f"{subjects.config_key(cfg.sender_model, cfg.receiver_model)}.v{cfg.profile_version}"


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def validate(cfg: schemas.RecomputeConfig) -> schemas.RecomputeConfig:
    """`cfg`, if a receiver could serve it: models named and bound to sha256s, every plan's
    groups inside the model and its layer count stated right, known codecs (lowrank ones naming
    their maps; patch layers only with them), finite qualities.
    Raises `BadRequestError` naming the first problem (decoding already checked the types)."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.transport import codecs

    if not cfg.sender_model or not cfg.receiver_model:
        raise BadRequestError("sender_model and receiver_model must be non-empty")
    for name in ("sender_sha256", "receiver_sha256"):
        if not _SHA256.match(getattr(cfg, name)):
            raise BadRequestError(f"{name} {getattr(cfg, name)!r} is not a lowercase hex sha256")
    if cfg.total_layers < 1 or cfg.profile_version < 0:
        raise BadRequestError(f"total_layers {cfg.total_layers} must be >= 1 and profile_version {cfg.profile_version} >= 0")
    if not 0 <= cfg.tolerance < 1:
        raise BadRequestError(f"tolerance {cfg.tolerance} outside [0, 1)")
    if not cfg.frontier:
        raise BadRequestError("frontier is empty")
    for where, p in [("chosen", cfg.chosen), *((f"frontier[{i}]", p) for i, p in enumerate(cfg.frontier))]:
        try:
            ReusePlan.recompute_groups(p.plan.groups).patched(p.plan.patch_layers).validate(cfg.total_layers)
            codecs.get(p.plan.codec)
        except DroidMeshError as e:
            raise BadRequestError(f"{where}: {e}") from None
        maps = p.plan.codec_params.get(codecs.MAPS_PARAM)
        if p.plan.codec == codecs.LOWRANK.name and not (isinstance(maps, str) and _SHA256.match(maps)):
            raise BadRequestError(f"{where}: a lowrank plan names its maps by sha256 (codec_params {codecs.MAPS_PARAM!r})")
        if p.plan.patch_layers and p.plan.codec != codecs.LOWRANK.name:
            raise BadRequestError(f"{where}: patch layers {p.plan.patch_layers} need the lowrank codec (their maps)")
        if p.wire_bytes_per_token < 0:
            raise BadRequestError(f"{where}: wire_bytes_per_token {p.wire_bytes_per_token} < 0")
        if p.recomputed_layers != sum(e - s for s, e in p.plan.groups):
            raise BadRequestError(f"{where}: recomputed_layers {p.recomputed_layers} but groups {p.plan.groups}")
        if not math.isfinite(p.quality):
            raise BadRequestError(f"{where}: quality {p.quality} is not a number")
    if not (math.isfinite(cfg.full_prefill_quality) and math.isfinite(cfg.full_reuse_quality)):
        raise BadRequestError("full_prefill_quality and full_reuse_quality must be numbers")
    if len(cfg.relay) > MAX_RELAY_BUCKETS or not all(0 <= b.lo < b.hi <= 1 for b in cfg.relay):
        raise BadRequestError(f"relay: at most {MAX_RELAY_BUCKETS} buckets, each with 0 <= lo < hi <= 1")
    return cfg


MAX_RELAY_BUCKETS = 16  # the audit writes 4
MAX_VERSION_AHEAD_S = 86400.0  # time-based versions are unix seconds: more than a day ahead is hostile


def refusal(cfg: schemas.RecomputeConfig, now: float | None = None) -> str | None:
    """Why a watcher must ignore `cfg` (None: take it). A config that would not validate, or whose
    version or creation time is far in the future (it would outrank every honest config forever),
    is refused; the watcher keeps its last good config and raises an alarm."""
    now = time.time() if now is None else now
    try:
        validate(cfg)
    except BadRequestError:
        return "invalid_config"
    if cfg.profile_version > now + MAX_VERSION_AHEAD_S or not math.isfinite(cfg.created_at) \
            or cfg.created_at > now + MAX_VERSION_AHEAD_S:
        return "future_version"
    return None


async def _deliver(on_config: OnConfig, cfg: schemas.RecomputeConfig, key: str) -> None:
    """Hand a config to the watcher unless it must be refused; a handler that fails on one
    config neither stops the watch nor keeps later configs from arriving."""
    reason = refusal(cfg)
    if reason is not None:
        alarm("recompute.config", reason)
        log.warning("config_refused", key=key, reason=reason)
        return
    try:
        await on_config(cfg)
    except Exception:
        alarm("recompute.config", "handler_failed")
        log.exception("config_handler_failed", key=key)


def _raise_if_cancelling() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ConfigBoard(Protocol):
    async def put(self, config: schemas.RecomputeConfig) -> None: ...

    async def watch(self, on_config: OnConfig) -> None: ...


CLUSTER_REPLICAS = 3  # copies of the bucket in a NATS cluster: survives the loss of any one node
_NO_ROOM_FOR_REPLICAS = (10023, 10074)  # JetStream: insufficient resources; replicas > 1 without a cluster


class NatsConfigBoard:
    """`replicas`: how many copies JetStream keeps of the bucket if this handle is the one that
    creates it (whoever touches it first: a profiler's put, or a watcher that finds none). None
    (the default) means 1 on a lone server and `CLUSTER_REPLICAS` when the server is part of a
    cluster (its INFO names one), falling back to 1 where the cluster has too few JetStream nodes.
    An existing bucket keeps its replicas (`nats kv edit --replicas` changes them)."""

    def __init__(self, nc: Any, retry_s: float = 2.0, replicas: int | None = None):
        self._nc = nc
        self._retry_s = retry_s
        self._replicas = replicas
        self._kv: Any = None

    def replicas(self) -> int:
        """The replicas a bucket created now gets (see the class docstring)."""
        if self._replicas is not None:
            return self._replicas
        info = getattr(self._nc, "_server_info", None) or {}  # the server's INFO (nats-py keeps it private)
        return CLUSTER_REPLICAS if info.get("cluster") else 1

    async def _bucket(self, create: bool) -> Any:
        if self._kv is None:
            js = self._nc.jetstream()
            if create:
                self._kv = await self._create(js)
            else:
                self._kv = await js.key_value(subjects.CONFIG_BUCKET)
        return self._kv

    async def _create(self, js: Any) -> Any:
        from nats.js.errors import APIError

        replicas = self.replicas()
        if replicas == 1:  # exactly the call a lone server always got
            return await js.create_key_value(bucket=subjects.CONFIG_BUCKET, history=5)
        try:
            return await js.create_key_value(bucket=subjects.CONFIG_BUCKET, history=5, replicas=replicas)
        except APIError as e:
            if self._replicas is not None or e.err_code not in _NO_ROOM_FOR_REPLICAS:
                raise
            log.warning("config_bucket_unreplicated", wanted=replicas, error=str(e))
            return await js.create_key_value(bucket=subjects.CONFIG_BUCKET, history=5)

    async def put(self, config: schemas.RecomputeConfig, deadline_s: float = 30.0) -> None:
        """Publish `config`. While a cluster elects a leader after losing a node, JetStream answers
        503 or times out; those are retried, paced by `retry_s`, until `deadline_s` has passed."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import ServiceUnavailableError

        end = asyncio.get_running_loop().time() + deadline_s
        while True:
            try:
                await (await self._bucket(create=True)).put(config_key(config), schemas.encode(config))
                return
            except (NatsTimeout, ServiceUnavailableError) as e:
                if asyncio.get_running_loop().time() + self._retry_s > end:
                    raise
                log.info("config_bucket_unavailable", error=repr(e), retry_s=self._retry_s)
                await asyncio.sleep(self._retry_s)

    async def snapshot(self) -> dict[str, schemas.RecomputeConfig | str] | None:
        """What the bucket holds now, by key: each config, or why its entry does not decode;
        None when no config was ever published (the bucket does not exist)."""
        from nats.js.errors import BucketNotFoundError

        try:
            kv = await self._bucket(create=False)
        except BucketNotFoundError:
            return None
        # Read each key's last entry directly rather than through a watcher: a watcher's
        # end-of-values marker can arrive before entries already in flight to it.
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        prefix = f"$KV.{subjects.CONFIG_BUCKET}."
        info = await self._nc.jetstream().stream_info(f"KV_{subjects.CONFIG_BUCKET}", subjects_filter=f"{prefix}>")
        found: dict[str, schemas.RecomputeConfig | str] = {}
        for subject in sorted((info.state.subjects or {}).keys()):
            key = subject[len(prefix):]
            try:
                entry = await kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):  # deleted or purged since the listing
                continue
            if not entry.value:
                continue
            try:
                found[key] = schemas.decode(entry.value, schemas.RecomputeConfig)
            except DroidMeshError as e:
                found[key] = str(e)
        return found

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
            # nats-py swallows a cancellation that lands while it flushes the subscription
            # (`except CancelledError: pass`): the stop that asked for it must not wait on a
            # watcher that would follow the bucket forever.
            _raise_if_cancelling()
            async for entry in watcher:
                _raise_if_cancelling()
                if entry is None or not entry.value:  # end of the initial replay, or a delete
                    continue
                try:
                    cfg = schemas.decode(entry.value, schemas.RecomputeConfig)
                except DroidMeshError as e:
                    alarm("recompute.config", e.code)
                    log.warning("bad_config_entry", key=entry.key, error=str(e))
                    continue
                await _deliver(on_config, cfg, entry.key)
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
                await _deliver(on_config, cfg, key)
