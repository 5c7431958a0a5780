"""A key's rates shared by every gateway replica: one token bucket per key in a key-value store
(a JetStream KV bucket, `quota_nats.py`), so N replicas together admit a key its limits once, not N times.

NATS stays off most requests: a replica *leases* a slice of a key's bucket (`lease_fraction` of a
minute's worth, at least what the request needs) with one compare-and-set, and serves requests
from the slice. Its next exchange with the store (when the slice is spent, or `lease_s` after it
was taken: `expire`) gives the whole unspent slice back and takes a fresh one. Capacity leaves the
bucket before it is spent, so the replicas together never admit more than the bucket held; what
one replica's slice keeps from the others is bounded by the slice's size and by `lease_s` (the
staleness). Tokens a reply used beyond its reservation (a long prompt) are a debt in the slice,
paid into the bucket at its next exchange. An admission the bucket refused is refused again
without asking it for up to `lease_s`, so a client hammering a spent key costs NATS nothing more.

The store is a peer's: an entry is checked before use (size, shape, finite numbers, a time not far
ahead) and one that fails is taken as an empty bucket as of now, and overwritten. Compare-and-set
conflicts are retried up to `MAX_TRIES` times, then the request is refused (429, retry in a
second): nothing is ever admitted unaccounted.

NATS away (not connected yet, a deadline passed, JetStream refusing): each replica goes on under
its own per-process `Quotas`, which it charges along with the shared bucket all the time, so the
fall-back starts from where this process stood. That is fail-open to local limits: N replicas may
then admit up to N times a key's limits. It is logged once when it starts
(`quota_shared_unavailable`) and once when it ends (`quota_shared_restored`); NATS is tried again
`retry_s` later. Every wait on the store has a deadline (`timeout_s`). Requests at once
(`max_concurrent`) are counted per replica. Buckets refill by the wall clock (`wall`), which the
replicas must share (NTP): a stored time ahead of a replica's clock refills nothing there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

import structlog

from droidmesh.shared.auth.keys import MAX_LIMIT, ApiKey
from droidmesh.shared.auth.quota import Quotas, check_size, requests_refused, tokens_short, tokens_spent
from droidmesh.shared.errors import QuotaExceededError

log = structlog.get_logger("quota")
MAX_TRIES = 8  # compare-and-set rounds per exchange before the request is refused
MAX_VALUE_BYTES = 256  # a stored entry is ~60 bytes
MAX_DEBT = 1e12  # the lowest token level believed (a long prompt overdraws; nothing overdraws that far)
MAX_AHEAD_S = 3600.0  # a stored time further ahead of this replica's clock is not believed
RETRY_S = 5.0  # after a failure, the store is left alone this long (local limits meanwhile)


class StoreUnavailableError(Exception):
    """The store cannot be reached or refused the operation (not a conflict)."""


class QuotaStore(Protocol):
    """Where the shared buckets live: one entry per key id, with a revision for compare-and-set."""

    async def get(self, key_id: str) -> tuple[bytes, int] | None:
        """The entry's value and revision; None when there is none. `StoreUnavailableError` else."""
        ...

    async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
        """Write `value` if the entry is still at `revision` (0: there is none yet); the new
        revision, or None when another writer got there first."""
        ...


class MemoryQuotaStore:
    """The store in one process, with the same compare-and-set (tests; a gateway shares it with
    nobody). `down`: every call fails as NATS away would."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.seq = 0
        self.down = False
        self.writes = 0

    async def get(self, key_id: str) -> tuple[bytes, int] | None:
        if self.down:
            raise StoreUnavailableError("store down")
        return self.entries.get(key_id)

    async def update(self, key_id: str, value: bytes, revision: int) -> int | None:
        if self.down:
            raise StoreUnavailableError("store down")
        if self.entries.get(key_id, (b"", 0))[1] != revision:
            return None
        self.seq += 1
        self.writes += 1
        self.entries[key_id] = (bytes(value), self.seq)
        return self.seq


@dataclasses.dataclass(frozen=True)
class Level:
    """A shared bucket: what it holds of each rate, as of wall-clock time `at`."""

    requests: float
    tokens: float
    at: float

    def refilled(self, key: ApiKey, now: float) -> Level:
        minutes = max(0.0, now - self.at) / 60.0  # a clock behind the stored time refills nothing
        return Level(min(float(key.requests_per_minute), self.requests + minutes * key.requests_per_minute),
                     min(float(key.tokens_per_minute), self.tokens + minutes * key.tokens_per_minute),
                     max(self.at, now))


def encode(level: Level) -> bytes:
    return json.dumps({"v": 1, "r": round(level.requests, 6), "t": round(level.tokens, 3), "at": round(level.at, 6)},
                      separators=(",", ":")).encode()


def decode(raw: object, now: float) -> Level | None:
    """The level a stored entry holds, or None when it is not one this module could have written."""
    if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_VALUE_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not (isinstance(doc, dict) and set(doc) == {"v", "r", "t", "at"} and type(doc["v"]) is int and doc["v"] == 1):
        return None
    values = [doc["r"], doc["t"], doc["at"]]
    if not all(type(x) in (int, float) and math.isfinite(x) for x in values):
        return None
    r, t, at = (float(x) for x in values)
    if not (-MAX_LIMIT <= r <= MAX_LIMIT and -MAX_DEBT <= t <= MAX_LIMIT and 0 <= at <= now + MAX_AHEAD_S):
        return None
    return Level(r, t, at)


class Reservation(NamedTuple):
    """Tokens reserved for one request, and whether the shared bucket was charged for them."""

    tokens: int
    shared: bool


@dataclasses.dataclass(eq=False)
class _Lease:
    """This replica's slice of one key's shared bucket."""

    key: ApiKey  # as last seen (a reloaded file may change its limits)
    requests: float = 0.0
    tokens: float = 0.0  # below 0: tokens used beyond reservations, owed to the bucket
    taken: float = 0.0  # clock time of the last exchange
    refused: str = ""  # why the bucket last refused an admission, repeated without asking it until `refused_until`
    refused_until: float = -math.inf
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one exchange at a time


class SharedQuotas:
    """`admit` / `reserve` / `settle` as `Quotas` has them, charged to the shared bucket (while a
    store is attached and answers) and to this process's `local` account."""

    def __init__(self, local: Quotas | None = None, store: QuotaStore | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 lease_fraction: float = 0.05, lease_s: float = 1.0, timeout_s: float = 0.5, retry_s: float = RETRY_S):
        self.local = local or Quotas(clock)
        self.store = store
        self._clock, self._wall = clock, wall
        self.lease_fraction, self.lease_s, self.timeout_s, self.retry_s = lease_fraction, lease_s, timeout_s, retry_s
        self._leases: dict[str, _Lease] = {}
        self._down_until = -math.inf
        self._down = False
        self._invalid: set[str] = set()  # key ids whose bad entry was logged (once each)

    def attach(self, store: QuotaStore) -> None:
        """Share the buckets through `store` from now on (the gateway, once NATS is connected)."""
        self.store = store

    @property
    def shared(self) -> bool:
        """Whether requests are charged to the shared buckets now (a store attached and not failing)."""
        return self.store is not None and self._clock() >= self._down_until

    @contextlib.asynccontextmanager
    async def admit(self, key: ApiKey) -> AsyncIterator[None]:
        """One request of `key` while the block runs (`Quotas.admit`, with the rate shared)."""
        self.local.check_concurrency(key)  # before the shared rate: a refusal here costs it nothing
        shared = await self._take(key, 1.0, 0.0)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.local.admit(key))
            except QuotaExceededError:
                if shared:
                    self._lease(key).requests += 1.0  # not admitted after all
                raise
            yield

    async def reserve(self, key: ApiKey, tokens: int) -> Reservation:
        """Take `tokens` (a request's max_new_tokens) from `key`'s budget, or refuse the request."""
        check_size(key, tokens)
        shared = await self._take(key, 0.0, float(tokens))
        try:
            self.local.reserve(key, tokens)
        except QuotaExceededError:
            if shared:
                self._lease(key).tokens += tokens
            raise
        return Reservation(tokens, shared)

    def settle(self, key: ApiKey, reservation: Reservation, used: int) -> None:
        """Replace a reservation with what the request used (may overdraw the buckets)."""
        self.local.settle(key, reservation.tokens, used)
        if reservation.shared:
            self._lease(key).tokens += reservation.tokens - used

    def inflight(self, key: ApiKey) -> int:
        return self.local.inflight(key)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of key ids a reloaded key file no longer has."""
        self.local.forget(keep)
        self._leases = {k: lease for k, lease in self._leases.items() if k in keep or lease.lock.locked()}

    def holding(self, key: ApiKey) -> tuple[float, float]:
        """(requests, tokens) this replica's slice of `key` holds now."""
        lease = self._leases.get(key.id)
        return (lease.requests, lease.tokens) if lease is not None else (0.0, 0.0)

    async def expire(self, force: bool = False) -> None:
        """Give back every slice taken `lease_s` ago or more (`force`: every slice, at shutdown).
        The gateway runs this every half `lease_s`; a failure leaves the slice for the next round."""
        now = self._clock()
        for lease in list(self._leases.values()):
            if not self.shared:
                return
            if lease.lock.locked() or (lease.requests == 0 and lease.tokens == 0):
                continue
            if force or now - lease.taken >= self.lease_s:
                async with lease.lock:
                    with contextlib.suppress(QuotaExceededError):  # contended: the next round gives it back
                        await self._guarded(lease, 0.0, 0.0, take=False)

    # -- the shared bucket --------------------------------------------------------------------
    def _lease(self, key: ApiKey) -> _Lease:
        lease = self._leases.get(key.id)
        if lease is None:
            lease = self._leases[key.id] = _Lease(key)
        lease.key = key
        return lease

    async def _take(self, key: ApiKey, requests: float, tokens: float) -> bool:
        """Charge the shared bucket (through this replica's slice); True when it was, False when no
        store answers (the local account alone decides). `QuotaExceededError` when the bucket
        cannot cover it. An admission (`requests`) needs the key's tokens not overdrawn."""
        if not self.shared:
            return False
        lease = self._lease(key)
        async with lease.lock:
            if not _covers(lease, requests, tokens):
                if requests and self._clock() < lease.refused_until:  # a client hammering a spent key costs NATS nothing
                    raise QuotaExceededError(lease.refused, retry_after_s=float(math.ceil(lease.refused_until - self._clock())))
                if not self.shared:  # failed while this request waited for the lock
                    return False
                if not await self._guarded(lease, requests, tokens, take=True):
                    return False
            lease.requests -= requests
            lease.tokens -= tokens
            return True

    async def _guarded(self, lease: _Lease, requests: float, tokens: float, take: bool) -> bool:
        """`_exchange`, False when the store failed (marked down: local limits for `retry_s`)."""
        try:
            await self._exchange(lease, requests, tokens, take)
        except (StoreUnavailableError, TimeoutError) as e:
            self._down_until = self._clock() + self.retry_s
            if not self._down:
                self._down = True
                log.warning("quota_shared_unavailable", error=type(e).__name__, retry_s=self.retry_s,
                            effect="each gateway enforces its keys' limits on its own until the store answers")
            return False
        except QuotaExceededError:  # the store answered: it is up
            self._restored()
            raise
        self._restored()
        return True

    def _restored(self) -> None:
        if self._down:
            self._down = False
            log.info("quota_shared_restored")

    async def _exchange(self, lease: _Lease, requests: float, tokens: float, take: bool) -> None:
        """Give the whole slice back and (with `take`) take what the request needs plus a fresh
        slice, in one compare-and-set; `QuotaExceededError` when the bucket holds too little (the
        slice goes back all the same)."""
        key, store = lease.key, self.store
        assert store is not None  # `shared` was checked
        for _ in range(MAX_TRIES):
            async with asyncio.timeout(self.timeout_s):
                got = await store.get(key.id)
            revision, level, bad = self._level(key, got)
            give_r, give_t = lease.requests, lease.tokens  # the lock is held: only `settle` moves tokens meanwhile
            r, t = level.requests + give_r, level.tokens + give_t
            refusal = _refusal(key, r, t, requests, tokens) if take else None
            take_r = take_t = 0.0
            if take and refusal is None:
                take_r = min(max(r, 0.0), max(requests, self._slice(key.requests_per_minute)))
                take_t = min(max(t, 0.0), max(tokens, self._slice(key.tokens_per_minute)))
            if refusal is not None and give_r == 0 and give_t == 0 and not bad:
                self._remember(lease, refusal, requests)
                raise refusal  # nothing to give back: no write
            # never above a full bucket: what a slice gives back was taken before the bucket refilled
            left = Level(min(float(key.requests_per_minute), r - take_r), min(float(key.tokens_per_minute), t - take_t),
                         level.at)
            try:
                async with asyncio.timeout(self.timeout_s):
                    written = await store.update(key.id, encode(left), revision)
            except BaseException:
                # Written or not, nobody can tell (a deadline, a cancellation, a lost reply): count what
                # the slice gave back as given and its debt as unpaid, so at worst less is admitted, never more.
                lease.requests -= max(give_r, 0.0)
                lease.tokens -= max(give_t, 0.0)
                raise
            if written is None:
                continue  # another replica wrote first: read again
            lease.requests += take_r - give_r
            lease.tokens += take_t - give_t
            lease.taken = self._clock()
            if refusal is not None:
                self._remember(lease, refusal, requests)
                raise refusal
            return
        raise QuotaExceededError("this key's shared quota is being updated by other gateways; retry", retry_after_s=1.0)

    def _level(self, key: ApiKey, got: tuple[bytes, int] | None) -> tuple[int, Level, bool]:
        """(revision, the bucket refilled to now, whether the entry was bad and must be overwritten
        even when nothing else would be written: else it would stay empty) from what the store returned."""
        now = self._wall()
        if got is None:
            return 0, Level(float(key.requests_per_minute), float(key.tokens_per_minute), now), False
        raw, revision = got
        level = decode(raw, now)
        bad = level is None
        if level is None:
            if key.id not in self._invalid:
                self._invalid.add(key.id)
                log.warning("quota_entry_invalid", key_id=key.id, bytes=len(raw) if isinstance(raw, bytes) else None,
                            effect="taken as an empty bucket now, and overwritten")
            level = Level(0.0, 0.0, now)
        if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
            raise StoreUnavailableError("the store returned no revision")
        return revision, level.refilled(key, now), bad

    def _remember(self, lease: _Lease, refusal: QuotaExceededError, requests: float) -> None:
        """Refuse the key's admissions here without asking the bucket again for a while: no longer
        than `lease_s` (what a slice may withhold anyway) nor than the refusal's Retry-After."""
        if requests:
            lease.refused, lease.refused_until = str(refusal), self._clock() + min(refusal.retry_after_s, self.lease_s)

    def _slice(self, capacity: int) -> float:
        return max(1.0, self.lease_fraction * capacity)


def _covers(lease: _Lease, requests: float, tokens: float) -> bool:
    if requests and (lease.requests < requests or lease.tokens <= 0):  # tokens <= 0: maybe overdrawn, ask the bucket
        return False
    return lease.tokens >= tokens


def _refusal(key: ApiKey, r: float, t: float, requests: float, tokens: float) -> QuotaExceededError | None:
    """Why the bucket (with this replica's slice given back: `r`, `t`) cannot cover a request."""
    if requests and r < requests:
        return requests_refused(key, (requests - r) * 60.0 / key.requests_per_minute)
    if requests and t <= 0:  # earlier replies overdrew the key's tokens
        return tokens_spent(key, (1.0 - t) * 60.0 / key.tokens_per_minute)
    if tokens and t < tokens:
        return tokens_short(key, t, int(tokens), (tokens - t) * 60.0 / key.tokens_per_minute)
    return None
