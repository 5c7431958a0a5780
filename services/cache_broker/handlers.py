"""Broker handlers: one function per subject, all on the event loop (the index is in memory).

Sender events arrive on per-sender subjects (`dm.cache.<kind>.<sender>`); NATS permissions pin a
sender's user to its own token, and `on_sender_event` refuses an event whose `sender_id` is not
the subject's, so no principal can announce, refresh or withdraw another sender's contexts. A
refused event (forged, malformed, another schema version, over a cap) raises an alarm
(`dm_control_rejected_total`) and a log line; nothing a message says reaches past this module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from droidmesh.services.cache_broker.index import CacheIndex, Refused
from droidmesh.shared.errors import BadRequestError, DroidMeshError
from droidmesh.shared.service.metrics import alarm
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("broker")

_KINDS: dict[str, type[schemas.CacheAvailable | schemas.CacheEvicted | schemas.SenderHeartbeat]] = {
    "available": schemas.CacheAvailable, "evicted": schemas.CacheEvicted, "heartbeat": schemas.SenderHeartbeat}


def _refuse(kind: str, reason: str, detail: str) -> None:
    alarm(kind, reason)
    log.warning("event_refused", kind=kind, reason=reason, detail=detail[:200])


Hello = Callable[[str], Awaitable[None]]  # ask one sender to re-announce its contexts


async def on_sender_event(index: CacheIndex, hello: Hello, subject: str, data: bytes) -> None:
    """An event on `dm.cache.<kind>.<sender>`: decode, check the speaker, apply. Never raises."""
    parts = subject.split(".")
    kind = parts[2] if len(parts) == 4 else ""
    if kind not in _KINDS:
        return _refuse("cache.event", "bad_subject", subject)
    try:
        msg = schemas.decode(data, _KINDS[kind])
    except DroidMeshError as e:
        return _refuse(f"cache.{kind}", e.code, str(e))
    if subjects.sender_token(subject) != subjects.model_token(msg.sender_id):
        return _refuse(f"cache.{kind}", "forged_sender", f"{msg.sender_id!r} on {subject}")
    try:
        if isinstance(msg, schemas.CacheAvailable):
            await on_available(index, msg)
        elif isinstance(msg, schemas.CacheEvicted):
            await on_evicted(index, msg)
        else:
            await on_heartbeat(index, hello, msg)
    except Refused as e:
        _refuse(f"cache.{kind}", e.reason, str(e))


async def on_available(index: CacheIndex, ev: schemas.CacheAvailable) -> None:
    index.add(ev)


async def on_evicted(index: CacheIndex, ev: schemas.CacheEvicted) -> None:
    index.remove(ev.sender_id, ev.context_id)


async def on_heartbeat(index: CacheIndex, hello: Hello, hb: schemas.SenderHeartbeat) -> None:
    if index.heartbeat(hb):  # back after being dropped (a freeze, a partition): index it again
        log.info("sender_returned", sender_id=hb.sender_id, contexts=len(hb.context_ids))
        await hello(hb.sender_id)


async def lookup(index: CacheIndex, req: schemas.LookupRequest) -> schemas.LookupReply:
    if len(req.models) > index.limits.max_senders:  # at most one model per sender could be usable
        raise BadRequestError(f"{len(req.models)} models named; at most {index.limits.max_senders}")
    holder, matched = index.lookup(req.token_ids, req.fingerprint_id, req.exclude_model, req.models)
    log.debug("lookup", tokens=len(req.token_ids), matched=matched, sender=holder.sender_id if holder else None)
    return schemas.LookupReply(holder=holder, matched_tokens=matched)
