"""The receiver never uses a holder of another scope, whatever the broker answers: it reads as a miss."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from droidmesh.services.receiver import holders
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.hashing import PUBLIC, tenant_scope
from tests.unit.services.test_index import _ev


class Broker:
    """A bus whose broker answers every lookup with `holder`, recording the requests."""

    def __init__(self, holder: schemas.CacheAvailable) -> None:
        self.holder, self.asked = holder, []

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        self.asked.append(schemas.decode(data, schemas.LookupRequest))
        return schemas.encode(schemas.LookupReply(holder=self.holder, matched_tokens=32))


def _lookup(holder_scope: str, asker: str) -> tuple[schemas.CacheAvailable | None, object, Broker]:
    bus = Broker(msgspec.structs.replace(_ev("s1", "c", list(range(32))), scope=holder_scope))
    s = SimpleNamespace(bus=bus, cfg=SimpleNamespace(lookup_timeout_s=1.0), metrics=Metrics("receiver"))
    holder, miss = asyncio.run(holders.lookup_in(s, list(range(40)), "fp", [], asker))  # type: ignore[arg-type]
    return holder, miss, bus


def test_a_holder_of_another_scope_is_a_miss():
    holder, miss, bus = _lookup(tenant_scope("a"), tenant_scope("b"))
    assert holder is None and miss == ("no_cache", "no cached prefix")
    assert bus.asked[0].scope == tenant_scope("b")  # the lookup carried the asker's scope


def test_its_own_scope_and_public_holders_are_used():
    assert _lookup(tenant_scope("a"), tenant_scope("a"))[0] is not None
    assert _lookup(PUBLIC, tenant_scope("a"))[0] is not None
