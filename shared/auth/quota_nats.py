"""The shared quota buckets in NATS: a JetStream key-value bucket (`subjects.QUOTA_BUCKET`), one
entry per API key id, written only by compare-and-set (`KeyValue.update` with the revision read).

The bucket is in memory (a rate bucket is worth nothing after a NATS restart: every key starts
full, as it would after a minute), keeps one revision per key, and drops an entry an hour after
its last write (a key idle that long is full anyway). The gateway finds it or creates it, with
one replica on a lone server and three in a cluster (one where fewer nodes run JetStream gets
one). The `gateway` NATS user may do exactly that: create and read this bucket's stream and
write its subjects (`shared/mesh/nats_auth.py`).

Every failure other than a conflict (no connection, a deadline, JetStream refusing) is a
`StoreUnavailableError`, after which `SharedQuotas` falls back to local limits for a while.
"""

from __future__ import annotations

from typing import Any

import structlog

from droidmesh.shared.auth.shared_quota import MAX_VALUE_BYTES, StoreUnavailableError
from droidmesh.shared.wire import subjects

log = structlog.get_logger("quota")
ENTRY_TTL_S = 3600.0
MAX_BUCKET_BYTES = 16 << 20  # 10,000 keys take under 1 MiB
CLUSTER_REPLICAS = 3
_NO_ROOM_FOR_REPLICAS = (10023, 10074)  # JetStream: insufficient resources; replicas > 1 without a cluster


class NatsQuotaStore:
    """`QuotaStore` over the connection `nc` (nats-py); each JetStream call waits `timeout_s` at most."""

    def __init__(self, nc: Any, timeout_s: float = 0.5):
        self._nc = nc
        self._timeout_s = timeout_s
        self._kv: Any = None

    async def _bucket(self) -> Any:
        from nats.js.errors import BucketNotFoundError

        if self._kv is None:
            js = self._nc.jetstream(timeout=self._timeout_s)
            try:
                self._kv = await js.key_value(subjects.QUOTA_BUCKET)
            except BucketNotFoundError:
                self._kv = await self._create(js)
        return self._kv

    async def _create(self, js: Any) -> Any:
        from nats.js.api import KeyValueConfig, StorageType
        from nats.js.errors import APIError

        info = getattr(self._nc, "_server_info", None) or {}  # the server's INFO (nats-py keeps it private)
        config = KeyValueConfig(bucket=subjects.QUOTA_BUCKET, history=1, ttl=ENTRY_TTL_S, max_value_size=MAX_VALUE_BYTES,
                                max_bytes=MAX_BUCKET_BYTES, storage=StorageType.MEMORY,
                                description="API keys' rate buckets, shared by the gateway's replicas")
        if info.get("cluster"):
            try:
                return await js.create_key_value(config, replicas=CLUSTER_REPLICAS)
            except APIError as e:
                if e.err_code not in _NO_ROOM_FOR_REPLICAS:
                    raise
                log.warning("quota_bucket_unreplicated", wanted=CLUSTER_REPLICAS, error=str(e))
        return await js.create_key_value(config)

    async def get(self, key_id: str) -> tuple[bytes, int] | None:
        from nats.errors import Error
        from nats.js.errors import KeyNotFoundError

        self._connected()
        try:
            entry = await (await self._bucket()).get(key_id)
        except KeyNotFoundError:
            return None
        except (Error, OSError, TimeoutError) as e:
            self._kv = None  # look the bucket up again next time (a cluster may have lost it)
            raise StoreUnavailableError(f"quota bucket: {type(e).__name__}") from e
        return (entry.value or b""), entry.revision

    async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
        from nats.errors import Error
        from nats.js.errors import KeyWrongLastSequenceError

        self._connected()
        try:
            written = await (await self._bucket()).update(key_id, value, last=revision)
        except KeyWrongLastSequenceError:
            return None
        except (Error, OSError, TimeoutError) as e:
            self._kv = None
            raise StoreUnavailableError(f"quota bucket: {type(e).__name__}") from e
        return int(written)

    def _connected(self) -> None:
        if not getattr(self._nc, "is_connected", True):  # reconnecting: fail now, not after a deadline
            raise StoreUnavailableError("NATS is not connected")
