"""Broker handlers: one function per subject, all on the event loop (the index is in memory).

Sender events arrive on per-sender subjects (`dm.cache.<kind>.<sender>`); NATS permissions pin a
sender's user to its own token, and every event whose `sender_id` is not the subject's is
refused, so no principal can announce, refresh or withdraw another sender's contexts. A refused
event (forged, malformed, another schema version, over a cap) raises an alarm
(`dm_control_rejected_total`) and a log line (one per kind and reason an interval: a flood of
refused events must not become a flood of log lines); nothing a message says reaches past this
module. How much of the loop each sender's events get is `intake.py`'s business; these functions
handle one event each.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from droidmesh.services.cache_broker.budget import LogThrottle
from droidmesh.services.cache_broker.index import CacheIndex, Refused
from droidmesh.shared.alarms import alarm
from droidmesh.shared.errors import BadRequestError, DroidMeshError
from droidmesh.shared.wire import schemas, subjects

log = structlog.get_logger("broker")

SenderMessage = schemas.CacheAvailable | schemas.CacheEvicted | schemas.SenderHeartbeat
_KINDS: dict[str, type[SenderMessage]] = {
    "available": schemas.CacheAvailable, "evicted": schemas.CacheEvicted, "heartbeat": schemas.SenderHeartbeat}
REFUSAL_LOG_S = 10.0
_refusals = LogThrottle(REFUSAL_LOG_S)


def _refuse(kind: str, reason: str, detail: str) -> None:
    alarm(kind, reason)
    if events := _refusals.due((kind, reason)):
        log.warning("event_refused", kind=kind, reason=reason, detail=detail[:200], events=events,
                    interval_s=REFUSAL_LOG_S)


Hello = Callable[[str], Awaitable[None]]  # ask one sender to re-announce its contexts


def event_kind(subject: str) -> str:
    """`available`, `evicted` or `heartbeat` for a sender event subject; "" for any other."""
    parts = subject.split(".")
    return parts[2] if len(parts) == 4 and parts[2] in _KINDS else ""


def _decode(subject: str, data: bytes) -> SenderMessage | None:
    """The event on `subject`, if well-formed and spoken by the subject's sender (else refused)."""
    kind = event_kind(subject)
    if not kind:
        _refuse("cache.event", "bad_subject", subject)
        return None
    try:
        msg = schemas.decode(data, _KINDS[kind])
    except DroidMeshError as e:
        _refuse(f"cache.{kind}", e.code, str(e))
        return None
    if subjects.sender_token(subject) != subjects.model_token(msg.sender_id):
        _refuse(f"cache.{kind}", "forged_sender", f"{msg.sender_id!r} on {subject}")
        return None
    return msg


def apply_sender_event(index: CacheIndex, subject: str, data: bytes) -> int:
    """An availability or eviction event on `dm.cache.<kind>.<sender>`: decode, check the speaker,
    apply. Never raises, never suspends. Returns how many of the sender's holders went to keep it
    within its byte budget."""
    msg = _decode(subject, data)
    try:
        if isinstance(msg, schemas.CacheAvailable):
            return index.add(msg)
        if isinstance(msg, schemas.CacheEvicted):
            index.remove(msg.sender_id, msg.context_id)
    except Refused as e:
        _refuse(f"cache.{event_kind(subject)}", e.reason, str(e))
    return 0


async def on_sender_event(index: CacheIndex, hello: Hello, subject: str, data: bytes) -> None:
    """Any event on `dm.cache.<kind>.<sender>`, handled now, whatever its sender's budget. Never raises."""
    if event_kind(subject) != "heartbeat":
        apply_sender_event(index, subject, data)
        return
    msg = _decode(subject, data)
    if isinstance(msg, schemas.SenderHeartbeat):
        try:
            await on_heartbeat(index, hello, msg)
        except Refused as e:
            _refuse("cache.heartbeat", e.reason, str(e))


async def on_heartbeat(index: CacheIndex, hello: Hello, hb: schemas.SenderHeartbeat) -> None:
    joined = not index.live(hb.sender_id)
    reannounce = index.heartbeat(hb)
    if joined:  # first heard, or heard again after it was declared dead: once per sender and return
        log.info("sender_live", sender_id=hb.sender_id, interval_s=hb.interval_s, contexts=len(hb.context_ids))
    if reannounce:  # back after being dropped (a freeze, a partition): index it again
        log.info("sender_returned", sender_id=hb.sender_id, contexts=len(hb.context_ids))
        await hello(hb.sender_id)


async def lookup(index: CacheIndex, req: schemas.LookupRequest) -> schemas.LookupReply:
    if len(req.models) > index.limits.max_senders:  # at most one model per sender could be usable
        raise BadRequestError(f"{len(req.models)} models named; at most {index.limits.max_senders}")
    holder, matched = index.lookup(req.token_ids, req.fingerprint_id, req.exclude_model, req.models, req.scope,
                                   exclude_sender=req.exclude_sender)
    log.debug("lookup", tokens=len(req.token_ids), matched=matched, sender=holder.sender_id if holder else None,
              scope=req.scope)
    return schemas.LookupReply(holder=holder, matched_tokens=matched)
