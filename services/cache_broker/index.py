"""The broker's index: contexts by chained block hashes, senders by liveness.

A context's token ids are cut into BLOCK-token blocks; block i's key hashes blocks 0..i (a
chain, as prefix caches do), so one dict probe per prompt block finds every context sharing
that many blocks. The exact shared prefix is then measured token by token. Holders are served
only while their sender is live (a heartbeat within `ttl_factor` intervals): a restarted broker
serves nobody until it has heard from them, so it never hands out a stale holder.

Everything here comes from the network, so nothing a message says can make the index grow
without bound or keep anything alive forever (`Limits`): senders and contexts per sender are
capped (a message over a cap is refused with `Refused`, the caller raises an alarm); the
heartbeat interval a sender declares is clamped, so liveness always lapses within
`ttl_factor * max_interval_s` of its last heartbeat; and a holder lapses `max_holder_age_s`
after the sender last announced it or listed it in a heartbeat, so a context a live sender
stopped listing is swept too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Collection

import xxhash
from droidmesh.shared.wire.hashing import common_prefix
from droidmesh.shared.wire.schemas import CacheAvailable, SenderHeartbeat

BLOCK = 16
MAX_TOKEN_ID = (1 << 32) - 1  # block keys hash 4 bytes per token


def block_keys(token_ids: list[int]) -> list[int]:
    """Chained hash of each full BLOCK-token block (the last partial block is not keyed)."""
    keys, h = [], xxhash.xxh3_64()
    for i in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[i : i + BLOCK]))
        keys.append(h.intdigest())
    return keys


def valid_token_ids(token_ids: list[int], max_tokens: int) -> bool:
    return 0 < len(token_ids) <= max_tokens and all(0 <= t <= MAX_TOKEN_ID for t in token_ids)


class Refused(Exception):
    """A message the index will not take; `reason` is the alarm's label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Limits:
    max_senders: int = 1024
    max_contexts_per_sender: int = 4096
    max_context_tokens: int = 1 << 18  # a 1 MiB event holds at most ~200K token ids anyway
    min_interval_s: float = 0.05
    max_interval_s: float = 30.0  # a sender declaring more is still dead after ttl_factor * this
    max_holder_age_s: float = 900.0  # a holder lapses this long after it was last announced or listed
    max_id_chars: int = 256


@dataclasses.dataclass
class SenderLiveness:
    last_seen: float
    interval_s: float


@dataclasses.dataclass
class Holder:
    ev: CacheAvailable
    stale_at: float  # monotonic: max_holder_age_s after it was last announced or listed in a heartbeat


class CacheIndex:
    def __init__(self, ttl_factor: float = 3.0, clock=time.monotonic, limits: Limits | None = None):
        self.ttl_factor = ttl_factor
        self.limits = limits or Limits()
        self._clock = clock
        self._holders: dict[str, dict[str, Holder]] = {}  # sender -> context -> holder
        self._by_key: dict[int, set[tuple[str, str]]] = defaultdict(set)
        self._senders: dict[str, SenderLiveness] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def senders(self) -> int:
        """Senders tracked: heart-beating or holding contexts."""
        return len(self._senders.keys() | self._holders.keys())

    def _check_id(self, what: str, value: str) -> None:
        if not value or len(value) > self.limits.max_id_chars:
            raise Refused("bad_field", f"{what} must be 1..{self.limits.max_id_chars} characters")

    def _admit_sender(self, sender_id: str) -> None:
        """A sender may be tracked: known already, or room for one more."""
        if sender_id not in self._senders and sender_id not in self._holders and self.senders() >= self.limits.max_senders:
            raise Refused("too_many_senders", f"{self.limits.max_senders} senders tracked already")

    def add(self, ev: CacheAvailable) -> None:
        """Index (or refresh) a holder; `Refused` when the event is malformed or over a cap."""
        lim = self.limits
        self._check_id("sender_id", ev.sender_id)
        self._check_id("context_id", ev.context_id)
        if len(ev.address) > lim.max_id_chars:
            raise Refused("bad_field", "address too long")
        if not valid_token_ids(ev.token_ids, lim.max_context_tokens):
            raise Refused("bad_field", f"token_ids must be 1..{lim.max_context_tokens} ids in [0, 2^32)")
        if not math.isfinite(ev.published_at):
            raise Refused("bad_field", "published_at must be finite")
        self._admit_sender(ev.sender_id)
        held = self._holders.get(ev.sender_id, {})
        if ev.context_id not in held and len(held) >= lim.max_contexts_per_sender:
            raise Refused("too_many_contexts", f"sender {ev.sender_id} holds {lim.max_contexts_per_sender} already")
        # Lapses max_holder_age_s from now unless heart-beats or a re-announcement keep it.
        stale_at = self._clock() + lim.max_holder_age_s
        self.remove(ev.sender_id, ev.context_id)  # a re-announcement may carry other token ids
        self._holders.setdefault(ev.sender_id, {})[ev.context_id] = Holder(ev, stale_at)
        self._count += 1
        ref = (ev.sender_id, ev.context_id)
        for k in block_keys(ev.token_ids):
            self._by_key[k].add(ref)

    def remove(self, sender_id: str, context_id: str) -> None:
        held = self._holders.get(sender_id)
        h = held.pop(context_id, None) if held is not None else None
        if h is None:
            return
        self._count -= 1
        if not held:
            del self._holders[sender_id]
        for k in block_keys(h.ev.token_ids):
            refs = self._by_key.get(k)
            if refs is not None:
                refs.discard((sender_id, context_id))
                if not refs:
                    del self._by_key[k]

    def heartbeat(self, hb: SenderHeartbeat) -> bool:
        """Mark the sender live and forget contexts it no longer lists (missed evictions). The
        declared interval is clamped: no heartbeat buys more than ttl_factor * max_interval_s.
        True when the sender comes back from the dead (or is new) listing contexts the index does
        not hold: it should re-announce them (its availability events went by while dropped)."""
        self._check_id("sender_id", hb.sender_id)
        if not math.isfinite(hb.interval_s) or hb.interval_s <= 0:
            raise Refused("bad_field", f"interval_s {hb.interval_s} must be a positive number")
        self._admit_sender(hb.sender_id)
        returning = not self.live(hb.sender_id)
        interval = min(max(hb.interval_s, self.limits.min_interval_s), self.limits.max_interval_s)
        self._senders[hb.sender_id] = SenderLiveness(self._clock(), interval)
        listed = set(hb.context_ids)
        held = self._holders.get(hb.sender_id, {})
        for cid in [c for c in held if c not in listed]:
            self.remove(hb.sender_id, cid)
        fresh = self._clock() + self.limits.max_holder_age_s
        for h in held.values():  # every one left is listed: still held
            h.stale_at = fresh
        return returning and any(cid not in held for cid in listed)

    def live(self, sender_id: str) -> bool:
        s = self._senders.get(sender_id)
        return s is not None and self._clock() - s.last_seen <= self.ttl_factor * s.interval_s

    def expire(self) -> list[str]:
        """Drop senders that stopped heart-beating, with all their contexts; return the dead
        senders' ids."""
        dead = [sid for sid in self._senders if not self.live(sid)]
        for sid in dead:
            del self._senders[sid]
            for cid in list(self._holders.get(sid, {})):
                self.remove(sid, cid)
        return dead

    def sweep(self) -> int:
        """Drop holders whose announcement went stale (and senders never heard from that hold
        nothing); return how many holders went."""
        now = self._clock()
        stale = [(sid, cid) for sid, held in self._holders.items() for cid, h in held.items() if h.stale_at < now]
        for sid, cid in stale:
            self.remove(sid, cid)
        return len(stale)

    def lookup(self, token_ids: list[int], fingerprint_id: str, exclude_model: str | None = None,
               models: Collection[str] = ()) -> tuple[CacheAvailable | None, int]:
        """The live, compatible holder sharing the longest token prefix, and that length; with
        `models`, a holder of one of them wins over any other (the asker can use only those), and
        the best of the others only when none of them matches."""
        if not valid_token_ids(token_ids, self.limits.max_context_tokens) or len(models) > self.limits.max_senders:
            return None, 0
        levels: list[set[tuple[str, str]]] = []  # holders sharing the first 1, 2, ... blocks
        for k in block_keys(token_ids):
            refs = self._by_key.get(k)
            if not refs:
                break
            levels.append(refs)
        wanted = frozenset(models)
        for refs in reversed(levels if wanted else []):  # deepest first: the first level with a usable holder has the best
            found = self._best(refs, token_ids, fingerprint_id, exclude_model, wanted)
            if found[0] is not None:
                return found
        return self._best(levels[-1] if levels else set(), token_ids, fingerprint_id, exclude_model, frozenset())

    def _best(self, refs: set[tuple[str, str]], token_ids: list[int], fingerprint_id: str, exclude_model: str | None,
              wanted: frozenset[str]) -> tuple[CacheAvailable | None, int]:
        """Of `refs`, the live, compatible holder (of a `wanted` model, if any named) sharing the
        longest prefix (the newest on a tie)."""
        best, best_len = None, 0
        now = self._clock()
        for sid, cid in refs:
            h = self._holders[sid][cid]
            ev = h.ev
            if ev.fingerprint_id != fingerprint_id or ev.model_id == exclude_model or h.stale_at < now or not self.live(sid):
                continue
            if wanted and ev.model_id not in wanted:
                continue
            n = common_prefix(ev.token_ids, token_ids)
            if n > best_len or (n == best_len and best is not None and ev.published_at > best.published_at):
                best, best_len = ev, n
        return best, best_len
