"""`NatsQuotaStore` against a fake nats-py connection: a conflict is None (read again), every
other failure is `StoreUnavailableError` (local limits for a while), a missing bucket is created
once, and a connection that is reconnecting fails at once instead of after a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from droidmesh.shared.auth.quota_nats import NatsQuotaStore
from droidmesh.shared.auth.shared_quota import StoreUnavailableError
from droidmesh.shared.wire.subjects import QUOTA_BUCKET


class Entry:
    def __init__(self, value: bytes, revision: int):
        self.value, self.revision = value, revision


class FakeKV:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.fail: BaseException | None = None

    async def get(self, key: str) -> Entry:
        if self.fail is not None:
            raise self.fail
        if key not in self.entries:
            raise KeyNotFoundError
        return self.entries[key]

    async def update(self, key: str, value: bytes, last: int) -> int:
        if self.fail is not None:
            raise self.fail
        if (self.entries[key].revision if key in self.entries else 0) != last:
            raise KeyWrongLastSequenceError
        self.entries[key] = Entry(value, last + 1)
        return last + 1


class FakeJS:
    def __init__(self, kv: FakeKV, exists: bool):
        self.kv, self.exists = kv, exists
        self.created: list[Any] = []

    async def key_value(self, bucket: str) -> FakeKV:
        assert bucket == QUOTA_BUCKET
        if not self.exists:
            raise BucketNotFoundError
        return self.kv

    async def create_key_value(self, config: Any, **params: Any) -> FakeKV:
        self.created.append(config)
        self.exists = True
        return self.kv


class FakeNC:
    def __init__(self, exists: bool = True):
        self.kv = FakeKV()
        self.js = FakeJS(self.kv, exists)
        self.is_connected = True
        self._server_info: dict[str, Any] = {}

    def jetstream(self, timeout: float) -> FakeJS:
        return self.js


def test_get_and_compare_and_set():
    nc = FakeNC()
    store = NatsQuotaStore(nc)

    async def go() -> list[Any]:
        return [await store.get("k"), await store.update("k", b"v1", 0), await store.update("k", b"v2", 0),
                await store.get("k"), await store.update("k", b"v2", 1)]

    assert asyncio.run(go()) == [None, 1, None, (b"v1", 1), 2]


def test_a_missing_bucket_is_created_once_in_memory_with_bounded_entries():
    nc = FakeNC(exists=False)
    store = NatsQuotaStore(nc)

    async def go() -> None:
        await store.get("k")
        await store.get("k")

    asyncio.run(go())
    (config,) = nc.js.created
    assert config.bucket == QUOTA_BUCKET and config.history == 1 and config.max_value_size == 256
    assert config.storage.value == "memory" and config.ttl > 0


@pytest.mark.parametrize("error", [NatsTimeout(), OSError("reset"), TimeoutError()])
def test_failures_are_store_unavailable_and_the_bucket_is_looked_up_again(error):
    nc = FakeNC()
    store = NatsQuotaStore(nc)
    nc.kv.fail = error

    async def go() -> None:
        with pytest.raises(StoreUnavailableError):
            await store.get("k")
        with pytest.raises(StoreUnavailableError):
            await store.update("k", b"v", 0)
        assert store._kv is None
        nc.kv.fail = None
        assert await store.update("k", b"v", 0) == 1

    asyncio.run(go())


def test_a_reconnecting_connection_fails_at_once():
    nc = FakeNC()
    nc.is_connected = False
    with pytest.raises(StoreUnavailableError, match="not connected"):
        asyncio.run(NatsQuotaStore(nc).get("k"))
