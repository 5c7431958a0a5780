"""The broker's index: contexts by chained block hashes, senders by liveness.

A context's token ids are cut into BLOCK-token blocks; block i's key hashes blocks 0..i (a
chain, as prefix caches do), so one dict probe per prompt block finds every context sharing
that many blocks. The chain is seeded by the context's scope (`shared.wire.hashing`): a lookup
walks its own scope's chain and the public one, so it never reaches another scope's holders
(and each holder's scope is compared once more before it is returned). The exact shared prefix
is then measured token by token. Holders are served only while their sender is live (a
heartbeat within `ttl_factor` intervals): a restarted broker serves nobody until it has heard
from them, so it never hands out a stale holder.

Everything here comes from the network, so nothing a message says can make the index grow
without bound or keep anything alive forever (`Limits`): senders and contexts per sender are
capped (a message over a cap is refused with `Refused`, the caller raises an alarm); the
heartbeat interval a sender declares is clamped, so liveness always lapses within
`ttl_factor * max_interval_s` of its last heartbeat; and a holder lapses `max_holder_age_s`
after the sender last announced it or listed it in a heartbeat, so a context a live sender
stopped listing is swept too.

Counts alone do not bound memory or work: 4096 contexts of 2^18 tokens each are within the caps
and would hold gigabytes. So the index also keeps bytes and work per event in check:
  - token ids are held packed (4 bytes each), not as a list of Python ints (~36 bytes each);
  - only the first `max_indexed_blocks` blocks of a context are keyed (a lookup hashes no more
    either); contexts sharing all of those are told apart by the token-by-token measure, so a
    lookup's answer is the same, and an event's hashing and inserting is bounded;
  - every holder is charged an estimate of the bytes it holds (`Holder.nbytes`: tokens, block
    keys, metadata); a sender over `max_sender_bytes` loses its own oldest holders to make room
    (it cannot push out anyone else's), and a new holder that would take the whole index over
    `max_index_bytes` with nothing of its sender's own left to give up is refused.
"""

from __future__ import annotations

import array
import dataclasses
import math
import sys
import time
from collections import defaultdict
from collections.abc import Collection, Sequence

import msgspec
import numpy as np
import xxhash

from droidmesh.shared.wire.hashing import PUBLIC, scope_seed
from droidmesh.shared.wire.schemas import CacheAvailable, SenderHeartbeat

BLOCK = 16  # tokens per block; a block key hashes their ids as 4 bytes each
# Byte estimates of what a holder keeps (checked against tracemalloc in the unit tests): one block
# key's slot in the key dict with its int and set of refs, plus its copy in the holder's key array;
# the fixed objects of a holder (its record, the event struct, the fingerprint, their headers); and
# one element of the event's per-layer lists as Python ints.
KEY_BYTES = 336
HOLDER_BYTES = 2048
LIST_ITEM_BYTES = 40
MAX_LAYER_ITEMS = 4096  # kv_nbytes / e_layers entries: one per layer, no model has more


def pack(token_ids: Sequence[int]) -> array.array | None:
    """Token ids as packed little-endian uint32 (None when one is out of [0, 2^32))."""
    try:
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def block_keys(token_ids: Sequence[int] | array.array, limit: int | None = None, scope: str = PUBLIC) -> list[int]:
    """Chained hash of each full BLOCK-token block (the last partial block is not keyed), of the
    first `limit` blocks at most, seeded by `scope`."""
    packed = token_ids if isinstance(token_ids, array.array) else pack(token_ids)
    if packed is None:
        raise ValueError("token ids must be in [0, 2^32)")
    n = len(packed) // BLOCK if limit is None else min(limit, len(packed) // BLOCK)
    raw, step = memoryview(packed).cast("B"), 4 * BLOCK
    keys, h = [], xxhash.xxh3_64(seed=scope_seed(scope))
    for i in range(n):
        h.update(raw[i * step : (i + 1) * step])
        keys.append(h.intdigest())
    return keys


def shared_prefix(a: array.array, b: array.array) -> int:
    """Length of the longest common prefix of two packed token-id sequences."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.frombuffer(a, np.uint32, n) != np.frombuffer(b, np.uint32, n))
    return int(diff[0]) if diff.size else n


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
    max_indexed_blocks: int = 256  # blocks keyed per context (and hashed per lookup)
    max_sender_bytes: int = 64 << 20  # one sender's holders, by `Holder.nbytes`
    max_index_bytes: int = 1 << 30  # every sender's holders together


@dataclasses.dataclass
class SenderLiveness:
    last_seen: float
    interval_s: float


@dataclasses.dataclass(slots=True)
class Holder:
    ev: CacheAvailable  # as announced, less its token ids (held packed in `tokens`)
    tokens: array.array
    keys: array.array  # its block keys, to unlink it without hashing again
    nbytes: int  # what it is charged against its sender's and the index's byte budgets
    stale_at: float  # monotonic: max_holder_age_s after it was last announced or listed in a heartbeat

    def event(self) -> CacheAvailable:
        """The event as announced, token ids and all."""
        return msgspec.structs.replace(self.ev, token_ids=self.tokens.tolist())


def _metadata_bytes(ev: CacheAvailable) -> int:
    """Estimate of what an event holds besides its token ids: its fields as encoded (strings keep
    about their encoded size), fixed objects, and its per-layer lists as Python ints."""
    fields = msgspec.msgpack.encode(msgspec.structs.replace(ev, token_ids=[]))
    return HOLDER_BYTES + len(fields) + LIST_ITEM_BYTES * (len(ev.kv_nbytes) + len(ev.e_layers))


class CacheIndex:
    def __init__(self, ttl_factor: float = 3.0, clock=time.monotonic, limits: Limits | None = None):
        self.ttl_factor = ttl_factor
        self.limits = limits or Limits()
        self._clock = clock
        self._holders: dict[str, dict[str, Holder]] = {}  # sender -> context -> holder, oldest announced first
        self._by_key: dict[int, set[tuple[str, str]]] = defaultdict(set)
        self._senders: dict[str, SenderLiveness] = {}
        self._sender_bytes: dict[str, int] = {}
        self._count = 0
        self.nbytes = 0  # every holder's `nbytes`

    def __len__(self) -> int:
        return self._count

    def senders(self) -> int:
        """Senders tracked: heart-beating or holding contexts."""
        return len(self._senders.keys() | self._holders.keys())

    def sender_bytes(self, sender_id: str) -> int:
        return self._sender_bytes.get(sender_id, 0)

    def _check_id(self, what: str, value: str) -> None:
        if not value or len(value) > self.limits.max_id_chars:
            raise Refused("bad_field", f"{what} must be 1..{self.limits.max_id_chars} characters")

    def _admit_sender(self, sender_id: str) -> None:
        """A sender may be tracked: known already, or room for one more."""
        if sender_id not in self._senders and sender_id not in self._holders and self.senders() >= self.limits.max_senders:
            raise Refused("too_many_senders", f"{self.limits.max_senders} senders tracked already")

    def add(self, ev: CacheAvailable) -> int:
        """Index (or refresh) a holder; `Refused` when the event is malformed or over a cap.
        Returns how many of the sender's oldest holders were dropped to keep it within its byte
        budget (and the index within its own)."""
        lim = self.limits
        self._check_id("sender_id", ev.sender_id)
        self._check_id("context_id", ev.context_id)
        if len(ev.address) > lim.max_id_chars:
            raise Refused("bad_field", "address too long")
        tokens = pack(ev.token_ids) if 0 < len(ev.token_ids) <= lim.max_context_tokens else None
        if tokens is None:
            raise Refused("bad_field", f"token_ids must be 1..{lim.max_context_tokens} ids in [0, 2^32)")
        if not math.isfinite(ev.published_at):
            raise Refused("bad_field", "published_at must be finite")
        if len(ev.kv_nbytes) > MAX_LAYER_ITEMS or len(ev.e_layers) > MAX_LAYER_ITEMS:
            raise Refused("bad_field", f"kv_nbytes and e_layers hold at most {MAX_LAYER_ITEMS} entries")
        self._admit_sender(ev.sender_id)
        held = self._holders.get(ev.sender_id, {})
        if ev.context_id not in held and len(held) >= lim.max_contexts_per_sender:
            raise Refused("too_many_contexts", f"sender {ev.sender_id} holds {lim.max_contexts_per_sender} already")
        keys = array.array("Q", block_keys(tokens, lim.max_indexed_blocks, ev.scope))
        nbytes = _metadata_bytes(ev) + tokens.itemsize * len(tokens) + KEY_BYTES * len(keys)
        if nbytes > min(lim.max_sender_bytes, lim.max_index_bytes):
            raise Refused("too_large", f"a holder of ~{nbytes} bytes is over the byte budget")
        old = held.get(ev.context_id)
        others = self.nbytes - (old.nbytes if old is not None else 0)
        mine = self.sender_bytes(ev.sender_id) - (old.nbytes if old is not None else 0)
        if others + nbytes > lim.max_index_bytes and others - mine + nbytes > lim.max_index_bytes:
            raise Refused("index_full", f"the index holds ~{self.nbytes} of {lim.max_index_bytes} bytes")
        self.remove(ev.sender_id, ev.context_id)  # a re-announcement may carry other token ids
        dropped = 0
        while self.sender_bytes(ev.sender_id) + nbytes > lim.max_sender_bytes or self.nbytes + nbytes > lim.max_index_bytes:
            self.remove(ev.sender_id, next(iter(self._holders[ev.sender_id])))  # its oldest announced
            dropped += 1
        # Lapses max_holder_age_s from now unless heart-beats or a re-announcement keep it.
        h = Holder(msgspec.structs.replace(ev, token_ids=[]), tokens, keys, nbytes, self._clock() + lim.max_holder_age_s)
        self._holders.setdefault(ev.sender_id, {})[ev.context_id] = h
        self._count += 1
        self._sender_bytes[ev.sender_id] = self.sender_bytes(ev.sender_id) + nbytes
        self.nbytes += nbytes
        ref = (ev.sender_id, ev.context_id)
        for k in keys:
            self._by_key[k].add(ref)
        return dropped

    def remove(self, sender_id: str, context_id: str) -> None:
        held = self._holders.get(sender_id)
        h = held.pop(context_id, None) if held is not None else None
        if h is None:
            return
        self._count -= 1
        self.nbytes -= h.nbytes
        self._sender_bytes[sender_id] -= h.nbytes
        if not held:
            del self._holders[sender_id]
            del self._sender_bytes[sender_id]
        for k in h.keys:
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
               models: Collection[str] = (), scope: str = PUBLIC, *, exclude_sender: str | None = None
               ) -> tuple[CacheAvailable | None, int]:
        """The live, compatible holder sharing the longest token prefix, and that length; with
        `models`, a holder of one of them wins over any other (the asker can use only those), and
        the best of the others only when none of them matches. Only holders of `scope` or public
        ones are found; on a tie the asker's own scope wins. `exclude_sender`: a holder id never
        returned (a receiver asking for another holder than itself)."""
        lim = self.limits
        tokens = pack(token_ids) if 0 < len(token_ids) <= lim.max_context_tokens else None
        if tokens is None or len(models) > lim.max_senders:
            return None, 0
        wanted = frozenset(models)
        found = [self._lookup_in(s, tokens, fingerprint_id, exclude_model, wanted, exclude_sender)
                 for s in dict.fromkeys((scope, PUBLIC))]
        return max(found, key=lambda f: (f[0] is not None and (not wanted or f[0].model_id in wanted), f[1]))

    def _lookup_in(self, scope: str, tokens: array.array, fingerprint_id: str, exclude_model: str | None,
                   wanted: frozenset[str], exclude_sender: str | None) -> tuple[CacheAvailable | None, int]:
        """`lookup` within one scope."""
        levels: list[set[tuple[str, str]]] = []  # holders sharing the first 1, 2, ... blocks
        for k in block_keys(tokens, self.limits.max_indexed_blocks, scope):
            refs = self._by_key.get(k)
            if not refs:
                break
            levels.append(refs)
        for refs in reversed(levels if wanted else []):  # deepest first: the first level with a usable holder has the best
            found = self._best(scope, refs, tokens, fingerprint_id, exclude_model, wanted, exclude_sender)
            if found[0] is not None:
                return found
        return self._best(scope, levels[-1] if levels else set(), tokens, fingerprint_id, exclude_model, frozenset(),
                          exclude_sender)

    def _best(self, scope: str, refs: set[tuple[str, str]], tokens: array.array, fingerprint_id: str,
              exclude_model: str | None, wanted: frozenset[str], exclude_sender: str | None
              ) -> tuple[CacheAvailable | None, int]:
        """Of `refs`, the live, compatible holder (of a `wanted` model, if any named) sharing the
        longest prefix (the newest on a tie)."""
        best: Holder | None = None
        best_len = 0
        now = self._clock()
        for sid, cid in refs:
            h = self._holders[sid][cid]
            ev = h.ev
            if (ev.fingerprint_id != fingerprint_id or ev.model_id == exclude_model or ev.scope != scope
                    or h.stale_at < now or not self.live(sid) or sid == exclude_sender):
                continue
            if wanted and ev.model_id not in wanted:
                continue
            n = shared_prefix(h.tokens, tokens)
            if n > best_len or (n == best_len and best is not None and ev.published_at > best.ev.published_at):
                best, best_len = h, n
        return (best.event() if best is not None else None), best_len
