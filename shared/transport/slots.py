"""A bulk server's connection slots: who may hold a connection, for how long, and who makes room.

Every channel's server (ucx and nixl through `control.ControlListener`, shm through its own accept
loop) admits each new connection here before reading a byte of it, marks each wait for its peer
(`Slot.waiting`) and reports each pull it completed (`Slot.pulled`). The rules (`SlotLimits`):
  - a connection that has completed no pull (it presented no valid grant yet) is held for at most
    `setup_s` from its accept, across all its waits: a peer that connects and says nothing,
    finishes the hello and idles, or sends only refused requests, lets go within seconds;
  - once it has completed a pull, each wait for its next request may last `idle_s` (a receiver
    keeps its connection to a sender cached between pulls);
  - one peer (`per_peer`: a source address; over shm the process the kernel names) holds at most
    that many connections: its next one takes the place of its own least recently active idle one;
  - one grantee (`per_grantee`: the NATS user the grants a connection pulls with went to, known
    from its first pull) holds at most that many: a connection's first pull takes the place of its
    grantee's least recently active idle connection, and is refused when they are all pulling, so
    one identity spread over many addresses (many hosts, or one host's many processes) cannot
    take the whole server from the others;
  - at `max_connections` a newcomer takes the place of the least recently active idle connection,
    those that never completed a pull first;
  - a connection in the middle of a pull is never taken (every pull is bounded by its channel's
    send or hold deadline); only when every slot it could take is busy is a newcomer refused.
Idle connections therefore cannot lock a receiver out: whatever they hold is given up on demand.
Every drop and refusal is counted (per server, `Slots.counts`, and per process, `dropped()`) and
logged at most once per LOG_EVERY_S per reason, with how many that line stands for.

Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from types import TracebackType

import structlog

from droidmesh.shared.errors import ConfigError

log = structlog.get_logger("transport")

MAX_CONNECTIONS = 256  # connections one server holds at once
PER_PEER = 32  # connections one peer holds at once
PER_GRANTEE = 128  # connections one grantee holds at once (every copy of a receiver model is one user)
SETUP_S = 10.0  # a connection's life until it completes its first pull
IDLE_S = 600.0  # a proven connection's wait for its next request
LOG_EVERY_S = 10.0  # at most one line per channel and reason in this long

# Why a connection was let go or refused (the reasons counted and logged).
SETUP_DEADLINE = "setup_deadline"  # no pull completed within setup_s
IDLE = "idle"  # a proven connection sent no request within idle_s
EVICTED = "evicted"  # its slot went to a newcomer (the server was full)
EVICTED_PEER = "evicted_peer"  # its slot went to a newcomer from the same peer (the peer was at its cap)
EVICTED_GRANTEE = "evicted_grantee"  # its slot went to another connection of its grantee (at its cap)
REFUSED = "refused"  # a newcomer found every slot it could take busy with a pull
REFUSED_GRANTEE = "refused_grantee"  # a first pull found every connection of its grantee pulling, at the cap
REASONS = (SETUP_DEADLINE, IDLE, EVICTED, EVICTED_PEER, EVICTED_GRANTEE, REFUSED, REFUSED_GRANTEE)

_DROPPED: collections.Counter[tuple[str, str]] = collections.Counter()  # (channel, reason) -> count


def dropped() -> dict[tuple[str, str], int]:
    """Connections let go or refused in this process, by (channel, reason), for metrics."""
    return dict(_DROPPED)


@dataclasses.dataclass(frozen=True)
class SlotLimits:
    """How many connections a server holds, per peer, and how long an idle one stays."""

    max_connections: int = MAX_CONNECTIONS
    per_peer: int = PER_PEER
    per_grantee: int = PER_GRANTEE
    setup_s: float = SETUP_S
    idle_s: float = IDLE_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1 (got {self.max_connections})")
        if not 1 <= self.per_peer <= self.max_connections:
            raise ConfigError(f"per_peer must be in [1, max_connections={self.max_connections}] (got {self.per_peer})")
        if self.per_grantee < 1:  # above max_connections it never binds: the server's cap comes first
            raise ConfigError(f"per_grantee must be >= 1 (got {self.per_grantee})")
        if not 0 < self.setup_s <= self.idle_s:
            raise ConfigError(f"need 0 < setup_s <= idle_s (got {self.setup_s}, {self.idle_s})")


class SlotEnded(Exception):
    """The connection's slot is gone (its deadline passed, or a newcomer took it): the handler
    ends the connection; the reason was counted and logged already."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Slot:
    """One admitted connection: its peer, its task (cancelled when its slot is taken) and what it
    has done so far."""

    def __init__(self, table: Slots, peer: str, task: asyncio.Task, now: float):
        self.peer, self.opened, self.last, self.pulls = peer, now, now, 0
        self.grantee = ""  # whose grants it pulls with, from its first pull that named one
        self.ended = ""  # why it was let go, once it was
        self._table, self._task = table, task
        self._waiting = False

    @property
    def proven(self) -> bool:
        """Whether it completed a pull (only then the long idle timeout applies)."""
        return self.pulls > 0

    @property
    def idle(self) -> bool:
        """Whether it waits for its peer (and may be taken): not in the middle of a pull."""
        return self._waiting and not self.ended

    def wait_s(self, now: float) -> float:
        """How long its next wait may last."""
        limits = self._table.limits
        return limits.idle_s if self.proven else self.opened + limits.setup_s - now

    def waiting(self) -> _Wait:
        """`async with slot.waiting():` around a wait for the peer: bounded by `wait_s`, and the
        slot may be taken meanwhile. Both end it with `SlotEnded`."""
        return _Wait(self)

    def claim(self, grantee: str) -> None:
        """Before a pull with `grantee`'s grant is served: count the connection as `grantee`'s (at
        its first such pull), making room among that grantee's idle connections at the cap;
        `SlotEnded` (refused, counted) when all of them are pulling. A connection whose grants
        change grantee is refused too: one connection, one identity."""
        if not grantee or grantee == self.grantee:
            return
        if self.grantee:
            self._table.drop(self, REFUSED_GRANTEE)
            raise SlotEnded(REFUSED_GRANTEE)
        self._table.bind(self, grantee)

    def pulled(self) -> None:
        """It completed a pull (answered without error and, where the channel has one, its done)."""
        self.pulls += 1
        self.last = time.monotonic()

    def evict(self, reason: str) -> None:
        """Take its slot: it ends at its current wait (`SlotEnded` there)."""
        self.ended = reason
        self._task.cancel()


class _Wait:
    def __init__(self, slot: Slot):
        self._slot = slot
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        slot = self._slot
        now = time.monotonic()
        left = slot.wait_s(now)
        if left <= 0:
            slot._table.drop(slot, SETUP_DEADLINE)
            raise SlotEnded(SETUP_DEADLINE)
        self._timeout = asyncio.timeout(left)
        await self._timeout.__aenter__()
        slot._waiting = True

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        slot, timeout = self._slot, self._timeout
        assert timeout is not None
        slot._waiting = False
        slot.last = time.monotonic()
        try:
            await timeout.__aexit__(et, e, tb)
        except TimeoutError:
            reason = IDLE if slot.proven else SETUP_DEADLINE
            slot._table.drop(slot, reason)
            raise SlotEnded(reason) from None
        # the cancel that `evict` sent (and nobody else's: the server closing cancels too)
        if et is asyncio.CancelledError and slot.ended and slot._task.uncancel() == 0:
            raise SlotEnded(slot.ended) from None


class Slots:
    """The connections one server holds (`channel` names it in logs and counts)."""

    def __init__(self, channel: str, limits: SlotLimits | None = None):
        self.channel, self.limits = channel, limits or SlotLimits()
        self.counts: collections.Counter[str] = collections.Counter()  # reason -> connections
        self._slots: dict[Slot, None] = {}  # in admission order
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._per_grantee: collections.Counter[str] = collections.Counter()
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last line's time, unlogged since)

    def __len__(self) -> int:
        return len(self._slots)

    def held(self) -> dict[str, int]:
        """Connections held per peer."""
        return {peer: n for peer, n in self._per_peer.items() if n}

    def held_by_grantee(self) -> dict[str, int]:
        """Connections held per grantee (those that pulled with a known one)."""
        return {g: n for g, n in self._per_grantee.items() if n}

    def bind(self, slot: Slot, grantee: str) -> None:
        """Count `slot` as `grantee`'s (`Slot.claim`): at the cap, `grantee`'s least recently
        active idle connection gives way; when none is idle, `slot` is refused (`SlotEnded`)."""
        if self._per_grantee[grantee] >= self.limits.per_grantee and not self._make_room(
                EVICTED_GRANTEE, None, grantee=grantee):
            self._note(REFUSED_GRANTEE, peer=slot.peer, grantee=grantee, cap=f"per_grantee={self.limits.per_grantee}")
            self.release(slot)
            slot.ended = REFUSED_GRANTEE
            raise SlotEnded(REFUSED_GRANTEE)
        slot.grantee = grantee
        self._per_grantee[grantee] += 1

    def admit(self, peer: str, task: asyncio.Task | None = None) -> Slot | None:
        """A slot for a new connection from `peer` served by `task` (default: the current task),
        taking an idle one's if needed; None when refused (counted and logged)."""
        task = task or asyncio.current_task()
        assert task is not None  # called from the connection's own task, or with it
        limits = self.limits
        if self._per_peer[peer] >= limits.per_peer and not self._make_room(EVICTED_PEER, peer):
            self._note(REFUSED, peer=peer, held_by_peer=self._per_peer[peer], cap=f"per_peer={limits.per_peer}")
            return None
        if len(self._slots) >= limits.max_connections and not self._make_room(EVICTED, None):
            self._note(REFUSED, peer=peer, cap=f"max_connections={limits.max_connections}")
            return None
        slot = Slot(self, peer, task, time.monotonic())
        self._slots[slot] = None
        self._per_peer[peer] += 1
        return slot

    def release(self, slot: Slot) -> None:
        """The connection ended (whatever ended it); its slot is free."""
        if slot in self._slots:
            del self._slots[slot]
            self._per_peer[slot.peer] -= 1
            if not self._per_peer[slot.peer]:
                del self._per_peer[slot.peer]
            if slot.grantee:
                self._per_grantee[slot.grantee] -= 1
                if not self._per_grantee[slot.grantee]:
                    del self._per_grantee[slot.grantee]

    def drop(self, slot: Slot, reason: str) -> None:
        """Let `slot` go for `reason` (its deadline passed): counted, logged, freed."""
        slot.ended = slot.ended or reason
        self._note(reason, peer=slot.peer, held_s=round(time.monotonic() - slot.opened, 3), pulls=slot.pulls)
        self.release(slot)

    def _make_room(self, reason: str, peer: str | None, grantee: str | None = None) -> bool:
        """Evict the least recently active idle slot (of `peer`, of `grantee`, or of anyone),
        never-proven ones first; False when every candidate is busy."""
        idle = [s for s in self._slots if s.idle and (peer is None or s.peer == peer)
                and (grantee is None or s.grantee == grantee)]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.proven, s.last))
        self.drop(victim, reason)
        victim.evict(reason)
        return True

    def _note(self, reason: str, **facts: object) -> None:
        """Count one drop or refusal; log it unless this reason was logged within LOG_EVERY_S."""
        self.counts[reason] += 1
        _DROPPED[(self.channel, reason)] += 1
        now = time.monotonic()
        last, unlogged = self._logged.get(reason, (float("-inf"), 0))
        if now - last < LOG_EVERY_S:
            self._logged[reason] = (last, unlogged + 1)
            return
        self._logged[reason] = (now, 0)
        event = f"{self.channel}_connection_refused" if reason == REFUSED else f"{self.channel}_connection_dropped"
        log.warning(event, reason=reason, unlogged_since=unlogged, total=self.counts[reason], held=len(self._slots),
                    **facts)
