"""The maps store: SCD maps files (`shared/kv/scd.py`), published with their pair's config.

A config names its maps by sha256 (`PlanSpec.codec_params["maps"]`); the file itself lives here.
`MapsStore` (coroutines on the caller's loop):
  - `put(data)`   the profiler / `droidmesh config publish`: store a file under its sha256; returns it
  - `get(sha)`    senders and receivers: the file, checked against its name (`IntegrityError` on a
                  mismatch, `MapsNotFoundError` when absent); never more than `MAX_MAPS_BYTES`
`load(store, sha, model_sha, side)` fetches, checks and registers a file with the `lowrank` codec.
Backed by a JetStream key-value bucket (`subjects.MAPS_BUCKET`) in chunks of `CHUNK_BYTES` under
`<sha>.<i>` and a manifest `<sha>` {"size", "chunks"}: NATS caps a message at 1 MiB, a maps file
for a large model is tens of MiB, and a KV bucket takes the same role permissions as the config
board. Files are immutable (named by content), so a reader never sees a half-replaced one.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Literal, Protocol

import structlog

from droidmesh.shared.errors import IntegrityError, MapsNotFoundError
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.schemas import LOWRANK_CODEC, MAPS_PARAM

if TYPE_CHECKING:
    from droidmesh.shared.kv import scd

log = structlog.get_logger("maps")
CHUNK_BYTES = 512 * 1024
MAX_MAPS_BYTES = 256 * 1024 * 1024  # a 70B model's maps at rank 32 are ~10 MiB; refuse anything absurd


class MapsStore(Protocol):
    async def put(self, data: bytes) -> str: ...

    async def get(self, sha256: str) -> bytes: ...


def _checked(data: bytes, sha256: str) -> bytes:
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise IntegrityError(f"maps {sha256[:12]}...: the stored file hashes to {got[:12]}...")
    return data


class InMemoryMapsStore:
    """In one process (tests)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    async def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.files[sha] = bytes(data)
        return sha

    async def get(self, sha256: str) -> bytes:
        if sha256 not in self.files:
            raise MapsNotFoundError(f"maps {sha256[:12]}... not published")
        return _checked(self.files[sha256], sha256)


class NatsMapsStore:
    def __init__(self, nc: Any):
        self._nc = nc
        self._kv: Any = None

    async def _bucket(self, create: bool) -> Any:
        if self._kv is None:
            js = self._nc.jetstream()
            if create:
                self._kv = await js.create_key_value(bucket=subjects.MAPS_BUCKET, history=1)
            else:
                self._kv = await js.key_value(subjects.MAPS_BUCKET)
        return self._kv

    async def put(self, data: bytes) -> str:
        if len(data) > MAX_MAPS_BYTES:
            raise IntegrityError(f"maps file of {len(data)} bytes; at most {MAX_MAPS_BYTES}")
        sha = hashlib.sha256(data).hexdigest()
        kv = await self._bucket(create=True)
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            await kv.put(f"{sha}.{i}", chunk)
        await kv.put(sha, json.dumps({"size": len(data), "chunks": len(chunks)}).encode())  # last: complete once visible
        return sha

    async def get(self, sha256: str) -> bytes:
        from nats.js.errors import BucketNotFoundError, KeyNotFoundError

        if not _is_sha(sha256):
            raise IntegrityError(f"maps name {sha256[:80]!r} is not a sha256")
        try:
            kv = await self._bucket(create=False)
            manifest = json.loads((await kv.get(sha256)).value)
            size, count = int(manifest["size"]), int(manifest["chunks"])
        except (BucketNotFoundError, KeyNotFoundError):
            raise MapsNotFoundError(f"maps {sha256[:12]}... not published") from None
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"maps {sha256[:12]}...: bad manifest ({e})") from None
        if not 0 <= size <= MAX_MAPS_BYTES or not 1 <= count <= size // CHUNK_BYTES + 1:
            raise IntegrityError(f"maps {sha256[:12]}...: manifest says {size} bytes in {count} chunks")
        parts, got = [], 0
        for i in range(count):
            try:
                chunk = (await kv.get(f"{sha256}.{i}")).value or b""
            except KeyNotFoundError:
                raise MapsNotFoundError(f"maps {sha256[:12]}...: chunk {i} of {count} missing") from None
            got += len(chunk)
            if got > size:
                raise IntegrityError(f"maps {sha256[:12]}...: chunks exceed the manifest's {size} bytes")
            parts.append(chunk)
        return _checked(b"".join(parts), sha256)


def _is_sha(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


Side = Literal["sender", "receiver"]


async def load(store: MapsStore, sha256: str, model_sha256: str, side: Side) -> scd.Maps:
    """Fetch maps `sha256`, check the file and that it was fitted for this model's weights on
    this `side` of the pair, and register it with the `lowrank` codec (once per process)."""
    from droidmesh.shared.kv import scd  # torch: only model services load maps
    from droidmesh.shared.transport import codecs

    if codecs.LOWRANK.has_maps(sha256):
        return codecs.LOWRANK.maps(sha256)
    maps = scd.Maps.from_bytes(await store.get(sha256), sha256)
    fitted_for = maps.meta.get(f"{side}_sha256")
    if fitted_for != model_sha256:
        raise IntegrityError(f"maps {sha256[:12]}... were fitted for {side} weights {str(fitted_for)[:12]}..., "
                             f"this {side} runs {model_sha256[:12]}...")
    codecs.LOWRANK.add_maps(maps)
    log.info("maps_loaded", maps=sha256[:12], side=side, ranks=len(maps.codes))
    return maps


def referenced(points: Any) -> set[str]:
    """The maps sha256s a config's frontier points name (lowrank points only)."""
    return {str(p.plan.codec_params.get(MAPS_PARAM)) for p in points
            if p.plan.codec == LOWRANK_CODEC and MAPS_PARAM in p.plan.codec_params}
