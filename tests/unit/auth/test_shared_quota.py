"""Rates shared by gateway replicas (`SharedQuotas`) against an in-process store with the KV
bucket's compare-and-set, under pinned clocks: two replicas of one key together never admit more
than its limit, slices go back, conflicts are retried, and a store that fails or hangs leaves each
replica its local limits (logged once) without a request waiting past the deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import structlog

from droidmesh.shared.auth.quota import Quotas
from droidmesh.shared.auth.shared_quota import (
    MAX_TRIES,
    Level,
    MemoryQuotaStore,
    Reservation,
    SharedQuotas,
    StoreUnavailableError,
    decode,
    encode,
)
from droidmesh.shared.errors import QuotaExceededError
from tests.unit.auth.test_quota import Clock, key


class Wall(Clock):
    def __init__(self) -> None:
        self.now = 1_700_000_000.0


@dataclasses.dataclass
class Replicas:
    clock: Clock
    wall: Wall
    store: MemoryQuotaStore
    a: SharedQuotas
    b: SharedQuotas


def replicas(store: MemoryQuotaStore | None = None, fraction: float = 0.05, lease_s: float = 1.0) -> Replicas:
    """Two gateway processes' quotas over one store (the replicas share the pinned clocks)."""
    clock, wall, store = Clock(), Wall(), store or MemoryQuotaStore()

    def one() -> SharedQuotas:
        return SharedQuotas(Quotas(clock), store, clock=clock, wall=wall, lease_fraction=fraction, lease_s=lease_s,
                            timeout_s=0.2, retry_s=5.0)

    return Replicas(clock, wall, store, one(), one())


async def admitted(q: SharedQuotas, k, n: int = 1) -> int:  # type: ignore[no-untyped-def]
    """How many of `n` admissions `q` grants (each request ends at once)."""
    ok = 0
    for _ in range(n):
        try:
            async with q.admit(k):
                ok += 1
        except QuotaExceededError:
            pass
    return ok


def test_two_replicas_sharing_a_key_admit_its_limit_once():
    """Alternating between the replicas, the key's 30 requests a minute are 30 in all; per process
    (the limits before they were shared) each replica would have admitted 30."""
    r, k = replicas(), key(rpm=30, conc=100)

    async def go() -> tuple[int, int, int]:
        a = b = 0
        for _ in range(40):
            a += await admitted(r.a, k)
            b += await admitted(r.b, k)
        per_process = SharedQuotas(Quotas(r.clock))  # no store: this process's limits alone
        return a, b, await admitted(per_process, k, 40)

    a, b, alone = asyncio.run(go())
    assert a + b == 30 and a > 0 and b > 0
    assert alone == 30


def test_concurrent_admissions_conflict_are_retried_and_stay_within_the_limit():
    """Admissions on both replicas at once, the store yielding between read and write: their
    compare-and-sets collide, are retried, and together still grant exactly the limit."""

    class Yielding(MemoryQuotaStore):
        conflicts = 0

        async def get(self, key_id: str) -> tuple[bytes, int] | None:
            await asyncio.sleep(0)
            return await super().get(key_id)

        async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
            await asyncio.sleep(0)
            written = await super().update(key_id, value, revision)
            self.conflicts += written is None
            return written

    store = Yielding()
    r, k = replicas(store), key(rpm=50, conc=1000)

    async def go() -> list[bool]:
        async def one(q: SharedQuotas) -> bool:
            return await admitted(q, k) == 1

        return list(await asyncio.gather(*(one(r.a if i % 2 else r.b) for i in range(80))))

    results = asyncio.run(go())
    assert sum(results) == 50 and store.conflicts > 0


def test_a_slice_goes_back_after_lease_s_and_the_other_replica_uses_it():
    r, k = replicas(fraction=0.25), key(rpm=20, conc=100)  # a slice: 5 requests

    async def go() -> tuple[int, int, int, tuple[float, float]]:
        first = await admitted(r.a, k)  # takes 5, spends 1
        b = await admitted(r.b, k, 30)  # the other 15, then refused: a holds 4
        await r.a.expire()  # too early: kept
        held = r.a.holding(k)
        r.clock.now += 1.0
        await r.a.expire()
        return first, b, await admitted(r.b, k, 30), held

    first, b, after, held = asyncio.run(go())
    assert (first, b, held[0]) == (1, 15, 4.0)
    assert after == 4 and r.a.holding(k)[0] == 0  # 20 in all


def test_refill_goes_by_the_wall_clock_and_a_clock_behind_refills_nothing():
    r, k = replicas(), key(rpm=60, conc=100)

    async def go() -> list[int]:
        out = [await admitted(r.a, k, 100)]
        r.wall.now += 10  # ten requests' worth
        out.append(await admitted(r.b, k, 100))
        behind = SharedQuotas(Quotas(r.clock), r.store, clock=r.clock, wall=lambda: r.wall.now - 30)
        out.append(await admitted(behind, k, 100))
        return out

    assert asyncio.run(go()) == [60, 10, 0]


def test_tokens_reserved_then_settled_and_a_debt_reaches_the_other_replica():
    """A reply that used more than its reservation overdraws the key's tokens; once the slice goes
    back the other replica refuses the key's next request too."""
    r, k = replicas(), key(tpm=100, conc=100)

    async def go() -> tuple[Reservation, float]:
        async with r.a.admit(k):
            res = await r.a.reserve(k, 10)
            r.a.settle(k, res, 300)  # a 290-token prompt: 200 over the whole budget
        debt = r.a.holding(k)[1]
        r.clock.now += 1.0
        await r.a.expire()
        with pytest.raises(QuotaExceededError, match="tokens per minute is spent"):
            async with r.b.admit(k):
                pass
        return res, debt

    res, debt = asyncio.run(go())
    assert res == Reservation(10, True) and debt < 0
    stored = decode(r.store.entries[k.id][0], r.wall.now)
    assert stored is not None and stored.tokens == pytest.approx(-200)


def test_a_reservation_larger_than_the_budget_or_the_bucket_is_refused():
    r, k = replicas(), key(tpm=50, conc=100)

    async def go() -> None:
        with pytest.raises(QuotaExceededError, match="exceeds"):
            await r.a.reserve(k, 51)
        await r.a.reserve(k, 40)
        with pytest.raises(QuotaExceededError, match="holds 10 now, 20 asked") as e:
            await r.b.reserve(k, 20)
        assert e.value.retry_after_s == 12.0  # 10 tokens at 50 a minute

    asyncio.run(go())


def test_conflicts_are_retried_and_endless_ones_refuse_rather_than_admit_unaccounted():
    class Contended(MemoryQuotaStore):
        """Another replica writes between each read and write, `times` times."""

        def __init__(self, times: int):
            super().__init__()
            self.times, self.attempts = times, 0

        async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
            self.attempts += 1
            if self.times > 0:
                self.times -= 1
                current = self.entries.get(key_id)
                self.seq += 1
                self.entries[key_id] = (current[0] if current else value, self.seq)
            return await super().update(key_id, value, revision)

    k = key(rpm=10, conc=100)
    some = Contended(3)
    assert asyncio.run(admitted(replicas(some).a, k)) == 1 and some.attempts == 4
    store = Contended(10**6)
    endless = replicas(store)

    async def refused() -> QuotaExceededError:
        with pytest.raises(QuotaExceededError, match="being updated") as e:
            async with endless.a.admit(k):
                pass
        return e.value

    assert asyncio.run(refused()).retry_after_s == 1.0
    assert endless.a.inflight(k) == 0 and store.attempts == MAX_TRIES and endless.a.holding(k) == (0.0, 0.0)


def test_a_store_down_leaves_local_limits_logged_once_then_sharing_resumes():
    """With the store failing, each replica admits what its own account still holds (where it
    stood: every shared admission was charged there too), saying so in one line; after retry_s
    the store is asked again and sharing resumes."""
    r, k = replicas(), key(rpm=10, conc=100)

    async def go() -> list[int]:
        out = [await admitted(r.a, k, 6)]
        r.store.down = True
        out.append(await admitted(r.a, k, 10))  # 4 left in a's own account
        out.append(await admitted(r.b, k, 20))  # b's own account: the whole 10 (not shared meanwhile)
        r.store.down = False
        r.clock.now += 60.0  # past retry_s; the shared bucket is full again, the local accounts too
        r.wall.now += 60.0
        out.append(await admitted(r.a, k, 6))
        out.append(await admitted(r.b, k, 20))
        return out

    with structlog.testing.capture_logs() as logs:
        counts = asyncio.run(go())
    assert counts == [6, 4, 10, 6, 4]
    events = [e["event"] for e in logs if e["event"].startswith("quota_shared")]
    assert events == ["quota_shared_unavailable"] * 2 + ["quota_shared_restored"] * 2  # once per replica each


def test_a_store_that_hangs_costs_a_request_the_deadline_once_then_none():
    class Hanging(MemoryQuotaStore):
        calls = 0

        async def get(self, key_id: str) -> tuple[bytes, int] | None:
            self.calls += 1
            await asyncio.Event().wait()  # never answers
            return None

    store = Hanging()
    r, k = replicas(store), key(rpm=5, conc=100)

    async def go() -> int:
        return await asyncio.wait_for(admitted(r.a, k, 8), 30)  # the deadline is 0.2 s: far from 30

    assert asyncio.run(go()) == 5 and store.calls == 1  # local limits; the store left alone after the first


def test_unavailable_store_errors_are_the_only_failures_taken_as_down():
    class Broken(MemoryQuotaStore):
        async def get(self, key_id: str) -> tuple[bytes, int] | None:
            raise StoreUnavailableError("JetStream not enabled")

    r = replicas(Broken())
    assert asyncio.run(admitted(r.a, key(rpm=3), 5)) == 3 and not r.a.shared
    r.clock.now += 5.0
    assert r.a.shared  # asked again after retry_s


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"[]", b"\xff\xfe", b'{"v":1,"r":1,"t":1}', b'{"v":2,"r":1,"t":1,"at":1}',
    b'{"v":true,"r":1,"t":1,"at":1}', b'{"v":1,"r":"1","t":1,"at":1}', b'{"v":1,"r":1e999,"t":1,"at":1}',
    b'{"v":1,"r":NaN,"t":1,"at":1}', b'{"v":1,"r":1,"t":1,"at":9e99}', b'{"v":1,"r":1,"t":-1e300,"at":1}',
    b'{"v":1,"r":1,"t":1,"at":1,"x":0}', b'{"v":1,"r":1,"t":1,"at":' + b"1" * 300 + b"}",
])
def test_a_stored_entry_is_checked_before_use(raw):
    assert decode(raw, 2e9) is None


def test_a_bad_entry_is_an_empty_bucket_now_logged_once_and_overwritten():
    r, k = replicas(), key(rpm=60, conc=100)
    r.store.entries[k.id] = (b'{"v":1,"r":1e9,"t":1e9,"at":0,"extra":"forged"}', 7)
    r.store.seq = 7

    async def go() -> list[int]:
        out = [await admitted(r.a, k, 3)]
        r.wall.now += 2  # two requests' worth
        r.clock.now += 2
        out.append(await admitted(r.a, k, 3))
        return out

    with structlog.testing.capture_logs() as logs:
        assert asyncio.run(go()) == [0, 2]
    assert [e["event"] for e in logs if e["event"] == "quota_entry_invalid"] == ["quota_entry_invalid"]
    assert decode(r.store.entries[k.id][0], r.wall.now) is not None  # overwritten with a good one


def test_encode_decode_round_trip_and_bounded_size():
    level = Level(-1e9, -1e12, 4e9)
    raw = encode(level)
    assert decode(raw, 4e9) == level and len(raw) < 100
    assert json.loads(encode(Level(0.1234567891, 2.0, 1.0)))["r"] == 0.123457


def test_a_removed_key_leaves_no_state_behind():
    r, k = replicas(), key(rpm=10)
    asyncio.run(admitted(r.a, k))
    assert r.a.holding(k) != (0.0, 0.0)
    r.a.forget(set())
    assert r.a.holding(k) == (0.0, 0.0)


def test_an_admission_the_local_account_refuses_gives_its_shared_request_back():
    """Local concurrency is checked before the shared rate is touched; a local refusal after the
    shared charge (a local bucket drained while sharing was down) puts the request back in the slice."""
    r, k = replicas(fraction=0.5), key(rpm=4, conc=1)

    async def go() -> tuple[float, float]:
        async with r.a.admit(k):
            before = r.a.holding(k)[0]
            with pytest.raises(QuotaExceededError, match="in flight"):
                async with r.a.admit(k):
                    pass
            return before, r.a.holding(k)[0]

    before, after = asyncio.run(go())
    assert before == after == 1.0


def test_a_refused_key_is_refused_again_without_asking_the_store_for_lease_s():
    """A client hammering a spent key costs one read of the bucket per `lease_s`, not one per request."""

    class Counting(MemoryQuotaStore):
        gets = 0

        async def get(self, key_id: str) -> tuple[bytes, int] | None:
            self.gets += 1
            return await super().get(key_id)

    store = Counting()
    r, k = replicas(store), key(rpm=2, conc=100)

    async def go() -> list[int]:
        out = [await admitted(r.a, k, 2)]
        before = store.gets
        out.append(await admitted(r.a, k, 50))
        out.append(store.gets - before)
        r.clock.now += 30.0  # one request refilled, long past lease_s: the bucket is asked again
        r.wall.now += 30.0
        out.append(await admitted(r.a, k, 5))
        out.append(store.gets - before)
        return out

    assert asyncio.run(go()) == [2, 0, 1, 1, 3]  # the admission's read, then the refusal's


def test_a_write_whose_fate_is_unknown_never_admits_more():
    """A slice given back by a write that timed out may or may not be in the bucket: it is counted
    as given (the replica no longer holds it), so the key loses at most that slice, never gains."""

    class HangingWrites(MemoryQuotaStore):
        hang = False

        async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
            if self.hang:
                await asyncio.Event().wait()
            return await super().update(key_id, value, revision)

    store = HangingWrites()
    r, k = replicas(store, fraction=0.25), key(rpm=20, conc=100)

    async def go() -> tuple[int, float, int]:
        a = await admitted(r.a, k)  # a holds 4 of its slice of 5
        store.hang = True
        r.clock.now += 1.0
        await asyncio.wait_for(r.a.expire(), 30)  # the give-back times out (0.2 s)
        held = r.a.holding(k)[0]
        store.hang = False
        r.clock.now += 5.0  # past retry_s
        return a, held, await admitted(r.b, k, 30) + await admitted(r.a, k, 30)

    a, held, rest = asyncio.run(go())
    assert (a, held) == (1, 0.0) and a + rest == 16  # the 4 in doubt are not admitted twice
