"""Sender events on their way into the index: budgets per sender, deferral, fair draining.

The bus hands one subscription's messages to its callback one after another, and a callback
that never suspends holds the event loop until it returns: a sender's heavy events, handled as
they come, would keep every heartbeat (same subscription) and lookup (same loop) waiting behind
them; the senders they were late for would be expired, the lookups time out. So here:
  - a heartbeat is handled at once: it is cheap, and missing it expires a sender. Each sender is
    heard at most `heartbeats_per_s` (a token bucket; more are dropped, an honest sender sends
    one an interval);
  - an availability or eviction event is handled at once while its sender is within its budgets
    and has nothing waiting: `events_per_s` and `cpu_share` seconds of loop time a second (token
    buckets, the time measured around each event). Otherwise it waits, still undecoded, in its
    sender's queue (bounded in bytes per sender and for all: past either it is dropped), and
    `run` drains the queues round-robin, one event per sender a turn, as budgets refill;
  - after each event the loop is yielded, so what waits (lookups, heartbeats) goes between two
    events, however many a sender sent.
One sender's events keep their order (an eviction never overtakes its announcement); a
heartbeat may overtake its sender's waiting events, which only delays what it lists. What goes
over a budget is counted (`dm_broker_over_budget_total{reason}`) and logged once an interval per
sender and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable

import structlog
from prometheus_client import Counter

from droidmesh.services.cache_broker import handlers
from droidmesh.services.cache_broker.budget import Bucket, LogThrottle
from droidmesh.services.cache_broker.index import CacheIndex

log = structlog.get_logger("broker")

QUEUED_OVERHEAD = 128  # bytes a waiting event costs besides its payload (its entry, its subject)
PRUNE_EVERY_S = 1.0  # idle senders' budgets are forgotten this often (and the worker wakes at least this often)


async def _no_hello(sender_id: str) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Budgets:
    events_per_s: float = 200.0
    event_burst: int = 4096
    cpu_share: float = 0.25
    cpu_burst_s: float = 0.5
    heartbeats_per_s: float = 10.0
    max_queued_bytes_per_sender: int = 32 << 20  # a re-announcement of ~1000 contexts of 8K tokens
    max_queued_bytes: int = 256 << 20
    max_senders: int = 2048  # senders with budgets held at once (idle ones are forgotten)
    log_every_s: float = 10.0


@dataclasses.dataclass(slots=True)
class SenderBudget:
    events: Bucket
    cpu: Bucket
    heartbeats: Bucket
    queue: deque[tuple[str, bytes]] = dataclasses.field(default_factory=deque)
    queued_bytes: int = 0

    @classmethod
    def fresh(cls, b: Budgets, now: float) -> SenderBudget:
        return cls(Bucket.full(b.events_per_s, b.event_burst, now), Bucket.full(b.cpu_share, b.cpu_burst_s, now),
                   Bucket.full(b.heartbeats_per_s, b.heartbeats_per_s, now))

    def wait_s(self, now: float) -> float:
        """Seconds until its next event may be handled (0: now)."""
        return max(self.events.wait_s(now, 1.0), self.cpu.wait_s(now, 0.0))

    def idle(self, now: float) -> bool:
        return not self.queue and self.events.is_full(now) and self.cpu.is_full(now) and self.heartbeats.is_full(now)


class Intake:
    """`on_event` is the callback of the sender-event subscription; `run` the loop draining what
    waits (supervised by the service)."""

    def __init__(self, index: CacheIndex, hello: handlers.Hello, budgets: Budgets, over_budget: Counter | None = None,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] = time.perf_counter):
        self.index, self.hello, self.budgets = index, hello, budgets
        self._over_budget = over_budget  # labelled by reason
        self._clock, self._timer = clock, timer  # budgets refill by `clock`; an event's cost is read off `timer`
        self._log = LogThrottle(budgets.log_every_s, clock)
        self._senders: dict[str, SenderBudget] = {}  # by subject token: the login NATS pinned to it
        self._waiting: dict[str, SenderBudget] = {}  # those with events queued, in turn order
        self._wake = asyncio.Event()
        self._pruned_at = clock()
        self.queued_events = 0
        self.queued_bytes = 0

    def over(self, sender: str, reason: str, n: int = 1) -> None:
        """Count `n` of a sender's events over a budget; log it (at most once an interval)."""
        if self._over_budget is not None:
            self._over_budget.labels(reason).inc(n)
        if events := self._log.due((sender, reason), n):
            log.warning("sender_over_budget", sender=sender, reason=reason, events=events, interval_s=self.budgets.log_every_s,
                        index_bytes=self.index.sender_bytes(sender), queued_bytes=self._queued_of(sender))

    def _queued_of(self, sender: str) -> int:
        s = self._senders.get(sender)
        return s.queued_bytes if s is not None else 0

    def _budget(self, sender: str, now: float) -> SenderBudget | None:
        s = self._senders.get(sender)
        if s is None:
            if len(self._senders) >= self.budgets.max_senders:
                self._prune(now)
                if len(self._senders) >= self.budgets.max_senders:
                    return None
            s = self._senders[sender] = SenderBudget.fresh(self.budgets, now)
        return s

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        for sender in [k for k, s in self._senders.items() if s.idle(now)]:
            del self._senders[sender]

    async def on_event(self, subject: str, data: bytes) -> None:
        """A message on `dm.cache.<kind>.<sender>`: a heartbeat now, an event now or later. Never raises."""
        kind = handlers.event_kind(subject)
        if not kind:  # refused, and cheaply
            return await handlers.on_sender_event(self.index, self.hello, subject, data)
        sender = subject.rsplit(".", 1)[-1]
        now = self._clock()
        budget = self._budget(sender, now)
        if budget is None:
            return self.over(sender, "too_many_senders")
        if kind == "heartbeat":
            if not budget.heartbeats.take(now):
                return self.over(sender, "heartbeat_dropped")
            # A heartbeat overtakes its sender's waiting events: contexts it lists that the index
            # lacks may be on their way (a re-announcement), so asking for them again would only
            # double the burst.
            hello = self.hello if not budget.queue else _no_hello
            return await handlers.on_sender_event(self.index, hello, subject, data)
        if budget.queue or budget.wait_s(now) > 0:
            return self._defer(sender, budget, subject, data)
        await self._handle(sender, budget, subject, data)

    def _defer(self, sender: str, budget: SenderBudget, subject: str, data: bytes) -> None:
        n = len(data) + QUEUED_OVERHEAD
        b = self.budgets
        if budget.queued_bytes + n > b.max_queued_bytes_per_sender or self.queued_bytes + n > b.max_queued_bytes:
            return self.over(sender, "dropped")
        budget.queue.append((subject, data))
        budget.queued_bytes += n
        self.queued_bytes += n
        self.queued_events += 1
        self._waiting.setdefault(sender, budget)
        self._wake.set()
        self.over(sender, "deferred")

    async def _handle(self, sender: str, budget: SenderBudget, subject: str, data: bytes) -> None:
        began = self._timer()
        dropped = handlers.apply_sender_event(self.index, subject, data)
        budget.cpu.spend(self._timer() - began)
        budget.events.spend(1.0)
        if dropped:
            self.over(sender, "evicted", dropped)
        await asyncio.sleep(0)  # what waits on the loop goes next, before this sender's next event

    async def turn(self) -> float:
        """Handle one waiting event of each sender whose budget allows; 0 if any was handled, else
        the seconds until one could be (at most PRUNE_EVERY_S)."""
        now = self._clock()
        handled, wait = False, PRUNE_EVERY_S
        for sender, budget in list(self._waiting.items()):
            w = budget.wait_s(now)
            if w > 0:
                wait = min(wait, w)
                continue
            subject, data = budget.queue.popleft()
            n = len(data) + QUEUED_OVERHEAD
            budget.queued_bytes -= n
            self.queued_bytes -= n
            self.queued_events -= 1
            if not budget.queue:
                del self._waiting[sender]
            await self._handle(sender, budget, subject, data)
            handled, now = True, self._clock()
        if now - self._pruned_at >= PRUNE_EVERY_S:
            self._prune(now)
        return 0.0 if handled else wait

    async def run(self) -> None:
        """Handle waiting events as their senders' budgets allow, one per sender a turn; between
        turns with nothing to do, sleep until a budget refills or an event is deferred."""
        while True:
            wait = await self.turn()
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
