"""Broker handlers: one function per subject, all on the event loop (the index is in memory)."""

from __future__ import annotations

import structlog

from droidmesh.services.cache_broker.index import CacheIndex
from droidmesh.shared.wire import schemas

log = structlog.get_logger("broker")


async def on_available(index: CacheIndex, ev: schemas.CacheAvailable) -> None:
    index.add(ev)


async def on_evicted(index: CacheIndex, ev: schemas.CacheEvicted) -> None:
    index.remove(ev.sender_id, ev.context_id)


async def on_heartbeat(index: CacheIndex, hb: schemas.SenderHeartbeat) -> None:
    index.heartbeat(hb)


async def lookup(index: CacheIndex, req: schemas.LookupRequest) -> schemas.LookupReply:
    holder, matched = index.lookup(req.token_ids, req.fingerprint_id, req.exclude_model)
    log.debug("lookup", tokens=len(req.token_ids), matched=matched, sender=holder.sender_id if holder else None)
    return schemas.LookupReply(holder=holder, matched_tokens=matched)
