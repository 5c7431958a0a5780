"""The recompute-config board: profilers publish per-pair configs, receivers and senders watch.

`ConfigBoard` (coroutines on the caller's loop):
  - `put(config)`        profiler: publish a pair's config under (sender, receiver, version)
  - `delete(s, r[, v])`  operators: withdraw a pair's configs (every version, or one)
  - `watch(on_config, on_withdrawn)`  receivers / senders: every current config, then each new
                         one, and each withdrawn one with the configs still in force, until
                         cancelled; the handlers run on the loop and must not block
`NatsConfigBoard.snapshot()` reads what the bucket holds now (`droidmesh config show`), and
`validate(config)` is what a config must satisfy to be published (`droidmesh config publish`).
Backed by a JetStream key-value bucket, so configs survive restarts and late joiners see them.

A config is in force while its key holds it: a delete or purge of the key (`droidmesh config
delete`, or `nats kv del`) withdraws it. The watcher hands `on_withdrawn` the withdrawn config
and every config it still holds, so a handler falls back to the newest that is left (another
version of the pair) or to none; a key gone while the watcher was away (a server restart, its
tombstone purged) is withdrawn when the re-opened watch has replayed the bucket without it.
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
# (the withdrawn config, every config the watch still holds: other pairs' and other versions')
OnWithdrawn = Callable[[schemas.RecomputeConfig, list[schemas.RecomputeConfig]], Awaitable[None]]
_GONE = ("DEL", "PURGE")  # the KV operations that leave a key empty


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
            if p.plan.codec == codecs.LAYERED.name:
                codecs.LAYERED.check(p.plan.codec_params, cfg.total_layers)
            _check_group(p.plan)
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


def _check_group(plan: schemas.PlanSpec) -> None:
    """An int4 group a plan asks for is a whole number in [1, quant.MAX_TOKEN_GROUP]: a sender would
    refuse any other at every pull. Whether it divides the head dim only a peer holding the model knows
    (the sender checks it as it encodes)."""
    from droidmesh.shared.kv.quant import MAX_TOKEN_GROUP
    from droidmesh.shared.transport import codecs

    group = plan.codec_params.get(codecs.GROUP_PARAM)
    if plan.codec in ("int4", codecs.LAYERED.name) and group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= MAX_TOKEN_GROUP):
        raise BadRequestError(f"int4 group {group!r}: a whole number of values in [1, {MAX_TOKEN_GROUP}]")


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


class _Held:
    """The configs one watch handed its handler, by key: what it withdraws when a key empties.
    Kept across re-opened watches (a replay re-delivers, handlers keep the newest version)."""

    def __init__(self, on_config: OnConfig, on_withdrawn: OnWithdrawn | None):
        self.on_config, self.on_withdrawn = on_config, on_withdrawn
        self.configs: dict[str, schemas.RecomputeConfig] = {}

    async def put(self, key: str, cfg: schemas.RecomputeConfig) -> None:
        """Hand a config to the watcher unless it must be refused (a refused one leaves the key's
        last good config in force); a handler that fails on one config neither stops the watch
        nor keeps later configs from arriving."""
        reason = refusal(cfg)
        if reason is not None:
            alarm("recompute.config", reason)
            log.warning("config_refused", key=key, reason=reason)
            return
        self.configs[key] = cfg
        try:
            await self.on_config(cfg)
        except Exception:
            alarm("recompute.config", "handler_failed")
            log.exception("config_handler_failed", key=key)

    async def gone(self, key: str) -> None:
        """`key` holds no config any more: withdraw the one handed over under it, if any."""
        cfg = self.configs.pop(key, None)
        if cfg is None:
            return
        log.info("config_withdrawn", key=key)
        if self.on_withdrawn is None:
            return
        try:
            await self.on_withdrawn(cfg, list(self.configs.values()))
        except Exception:
            alarm("recompute.config", "handler_failed")
            log.exception("config_handler_failed", key=key)

    async def keep_only(self, present: set[str]) -> None:
        """After a replay: every key held but not replayed is gone."""
        for key in sorted(self.configs.keys() - present):
            await self.gone(key)


def _raise_if_cancelling() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ConfigBoard(Protocol):
    async def put(self, config: schemas.RecomputeConfig) -> None: ...

    async def delete(self, sender_model: str, receiver_model: str, version: int | None = None) -> list[str]: ...

    async def watch(self, on_config: OnConfig, on_withdrawn: OnWithdrawn | None = None) -> None: ...


def _pair_keys(found: dict[str, schemas.RecomputeConfig | str], sender_model: str, receiver_model: str,
               version: int | None) -> list[str]:
    """The keys of `found` holding the pair's configs (exactly these model ids: two ids may share a
    key's tokens), of `version` or every one, oldest first: the newest stays in force until last."""
    keys = [(c.profile_version, k) for k, c in found.items() if isinstance(c, schemas.RecomputeConfig)
            and (c.sender_model, c.receiver_model) == (sender_model, receiver_model)
            and version in (None, c.profile_version)]
    return [k for _, k in sorted(keys)]


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

    async def delete(self, sender_model: str, receiver_model: str, version: int | None = None) -> list[str]:
        """Withdraw the pair's configs, every version or `version` (oldest first), by purging their
        keys: watchers drop them at once. Returns the keys purged ([] when the pair has none)."""
        found = await self.snapshot()
        if not found:
            return []
        keys = _pair_keys(found, sender_model, receiver_model, version)
        kv = await self._bucket(create=False)
        for key in keys:
            await kv.purge(key)
        return keys

    async def watch(self, on_config: OnConfig, on_withdrawn: OnWithdrawn | None = None) -> None:
        """Follow the bucket forever; a broken watcher (server restart) is re-opened and
        replays the current configs (handlers keep the newest version, so replays are harmless)."""
        held = _Held(on_config, on_withdrawn)
        while True:
            try:
                await self._watch_once(held)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("config_watch_restarting", error=repr(e))
                self._kv = None
                await asyncio.sleep(self._retry_s)

    async def _watch_once(self, held: _Held) -> None:
        watcher = await (await self._open_for_watch()).watchall()
        replayed: set[str] | None = set()  # the keys of the replay (last entry per key), until its end
        try:
            # nats-py swallows a cancellation that lands while it flushes the subscription
            # (`except CancelledError: pass`): the stop that asked for it must not wait on a
            # watcher that would follow the bucket forever.
            _raise_if_cancelling()
            async for entry in watcher:
                _raise_if_cancelling()
                if entry is None:  # the end of the replay: keys held but not in it are gone
                    if replayed is not None:
                        await held.keep_only(replayed)
                        replayed = None
                    continue
                if replayed is not None:
                    replayed.add(entry.key)
                if entry.operation in _GONE or not entry.value:  # deleted or purged: withdrawn
                    await held.gone(entry.key)
                    continue
                try:
                    cfg = schemas.decode(entry.value, schemas.RecomputeConfig)
                except DroidMeshError as e:
                    alarm("recompute.config", e.code)
                    log.warning("bad_config_entry", key=entry.key, error=str(e))
                    continue
                await held.put(entry.key, cfg)
        finally:
            await watcher.stop()


class InMemoryConfigBoard:
    """In-process twin for tests: `watch` replays what was put, then follows new puts and deletes."""

    def __init__(self) -> None:
        self._configs: dict[str, tuple[int, schemas.RecomputeConfig]] = {}  # key -> (revision, config)
        self._revision = 0
        self._new = asyncio.Condition()

    async def put(self, config: schemas.RecomputeConfig) -> None:
        async with self._new:
            self._revision += 1
            self._configs[config_key(config)] = (self._revision, config)
            self._new.notify_all()

    async def delete(self, sender_model: str, receiver_model: str, version: int | None = None) -> list[str]:
        async with self._new:
            keys = _pair_keys({k: c for k, (_, c) in self._configs.items()}, sender_model, receiver_model, version)
            for key in keys:
                del self._configs[key]
            self._new.notify_all()
        return keys

    async def watch(self, on_config: OnConfig, on_withdrawn: OnWithdrawn | None = None) -> None:
        held = _Held(on_config, on_withdrawn)
        seen: dict[str, int] = {}  # key -> the revision handed over
        while True:
            async with self._new:
                fresh = [(k, r, c) for k, (r, c) in self._configs.items() if seen.get(k) != r]
                gone = [k for k in seen if k not in self._configs]
                if not (fresh or gone):
                    await self._new.wait()
                    continue
            for key in gone:
                del seen[key]
                await held.gone(key)
            for key, revision, cfg in fresh:
                seen[key] = revision
                await held.put(key, cfg)
