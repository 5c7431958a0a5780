"""The broker's index: contexts by chained block hashes, senders by liveness.

A context's token ids are cut into BLOCK-token blocks; block i's key hashes blocks 0..i (a
chain, as prefix caches do), so one dict probe per prompt block finds every context sharing
that many blocks. The exact shared prefix is then measured token by token. Holders are served
only while their sender is live (a heartbeat within `ttl_factor` intervals): a restarted broker
serves nobody until it has heard from them, so it never hands out a stale holder.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import xxhash

from droidmesh.shared.hashing import common_prefix
from droidmesh.shared.wire.schemas import CacheAvailable, SenderHeartbeat

BLOCK = 16


def block_keys(token_ids: list[int]) -> list[int]:
    """Chained hash of each full BLOCK-token block (the last partial block is not keyed)."""
    keys, h = [], xxhash.xxh3_64()
    for i in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[i : i + BLOCK]))
        keys.append(h.intdigest())
    return keys


@dataclasses.dataclass
class SenderLiveness:
    last_seen: float
    interval_s: float


class CacheIndex:
    def __init__(self, ttl_factor: float = 3.0, clock=time.monotonic):
        self.ttl_factor = ttl_factor
        self._clock = clock
        self._holders: dict[tuple[str, str], CacheAvailable] = {}  # (sender, context) -> event
        self._by_key: dict[int, set[tuple[str, str]]] = defaultdict(set)
        self._senders: dict[str, SenderLiveness] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, ev: CacheAvailable) -> None:
        ref = (ev.sender_id, ev.context_id)
        self._holders[ref] = ev
        for k in block_keys(ev.token_ids):
            self._by_key[k].add(ref)

    def remove(self, sender_id: str, context_id: str) -> None:
        ev = self._holders.pop((sender_id, context_id), None)
        if ev is None:
            return
        for k in block_keys(ev.token_ids):
            refs = self._by_key.get(k)
            if refs is not None:
                refs.discard((sender_id, context_id))
                if not refs:
                    del self._by_key[k]

    def heartbeat(self, hb: SenderHeartbeat) -> None:
        """Mark the sender live and forget contexts it no longer lists (missed evictions)."""
        self._senders[hb.sender_id] = SenderLiveness(self._clock(), hb.interval_s)
        listed = set(hb.context_ids)
        for sender, cid in [r for r in self._holders if r[0] == hb.sender_id]:
            if cid not in listed:
                self.remove(sender, cid)

    def live(self, sender_id: str) -> bool:
        s = self._senders.get(sender_id)
        return s is not None and self._clock() - s.last_seen <= self.ttl_factor * s.interval_s

    def expire(self) -> list[str]:
        """Drop senders that stopped heart-beating, with all their contexts; return their ids."""
        dead = [sid for sid in self._senders if not self.live(sid)]
        for sid in dead:
            del self._senders[sid]
            for sender, cid in [r for r in self._holders if r[0] == sid]:
                self.remove(sender, cid)
        return dead

    def lookup(self, token_ids: list[int], fingerprint_id: str, exclude_model: str | None = None
               ) -> tuple[CacheAvailable | None, int]:
        """The live, compatible holder sharing the longest token prefix, and that length."""
        candidates: set[tuple[str, str]] = set()
        for k in block_keys(token_ids):
            refs = self._by_key.get(k)
            if not refs:
                break
            candidates = refs
        best, best_len = None, 0
        for ref in candidates:
            ev = self._holders[ref]
            if ev.fingerprint_id != fingerprint_id or ev.model_id == exclude_model or not self.live(ev.sender_id):
                continue
            n = common_prefix(ev.token_ids, token_ids)
            if n > best_len or (n == best_len and best is not None and ev.published_at > best.published_at):
                best, best_len = ev, n
        return best, best_len
