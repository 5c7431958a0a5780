"""Receiver handlers: one function per subject, wired by `service.py`; all run on the event loop.

`generate` (the model's queue-group subject) admits a request: duplicates share one answer, past
`max_queued_requests` a request is refused, the request is checked (`checks.py`) and answered
(`answer.py`). `on_config` (the config board) keeps the newest recompute config per sender model
and fetches the codec maps it names; `on_withdrawn` falls back when the board withdraws it;
`on_endpoint` (senders' endpoint events) warms bulk channels.
Nothing here blocks the loop but `checks.prompt_ids`, which tokenizes a prompt bounded by
`max_prompt_chars` and `checks.check_room` (one the model's positions could not hold is refused
before tokenizing); the rest awaits the bus, the maps bucket and the torch thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import TYPE_CHECKING

import msgspec
import structlog

from droidmesh.services.receiver import answer
from droidmesh.services.receiver.answer_stream import AnswerStream
from droidmesh.services.receiver.checks import (
    check,
    check_deadline,
    check_positions,
    check_room,
    deadline_of,
    prompt_chars,
    prompt_ids,
)
from droidmesh.shared.errors import DroidMeshError, OverloadedError
from droidmesh.shared.holding import grants
from droidmesh.shared.kv import policy
from droidmesh.shared.mesh import maps_store
from droidmesh.shared.mesh.caller import CALLER, request_scope
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import SenderEndpoint
from droidmesh.shared.wire.generation import GenerateRequest

if TYPE_CHECKING:
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


async def generate(s: ReceiverState, req: GenerateRequest) -> schemas.GenerateReply:
    """Answer over a shared context: reuse a sender's cache per the pair's plan, else full prefill.

    The request is checked first (`checks.check`); tokens are chosen by its sampling and the
    answer ends before its first stop string; with a `stream_subject` the answer is also
    published there as it is decoded (`answer_stream.py`), every chunk before the reply.
    Duplicates (a client's retry, or NATS redelivering after a reconnect: the same id and the same
    bytes) share one answer: the first copy computes it (and streams it), later copies await the
    same result. Another request that reuses a known id is a different key: it gets its own answer.
    Past `max_queued_requests` held at once, a new request is refused at once ("overloaded")."""
    arrived = time.monotonic()  # the budget counts from here: no clock is compared with the client's
    caller = CALLER.get()
    key = (req.request_id, caller, hashlib.blake2b(schemas.encode(req), digest_size=16).digest())
    known = s.replies.get(key)
    if known is not None:
        log.info("duplicate_request", request_id=req.request_id)
        return await asyncio.shield(known)
    if s.inflight >= s.cfg.max_queued_requests:
        s.metrics.requests.labels("refused", "overloaded").inc()
        raise OverloadedError(f"receiver {s.cfg.receiver_id} holds {s.inflight} requests "
                              f"(max_queued_requests={s.cfg.max_queued_requests}); retry later or elsewhere")
    fut: asyncio.Future = asyncio.get_running_loop().create_future()
    s.remember(key, fut)
    s.inflight += 1
    try:
        reply = await _generate(s, req, arrived, caller)
        fut.set_result(reply)
        return reply
    except BaseException as e:
        s.replies.pop(key, None)  # a failed attempt may be retried afresh
        fut.set_exception(e)
        fut.exception()  # mark retrieved: duplicates waiting on it re-raise it themselves
        raise
    finally:
        s.inflight -= 1


async def _generate(s: ReceiverState, req: GenerateRequest, arrived: float, caller: str) -> schemas.GenerateReply:
    t0 = time.perf_counter()
    deadline = deadline_of(req, arrived, s.cfg.request_timeout_s)
    check_deadline(deadline, "before start")
    check(req, s.cfg)
    # from here on the request's scope is the one it reads and is held in (its caller's own)
    req = msgspec.structs.replace(req, scope=request_scope(req.scope, caller, s.cfg.public_holding))
    check_room(s.model, prompt_chars(req), req.max_new_tokens)  # before tokenizing: O(1)
    prompt = prompt_ids(s.model.tokenizer, req)
    check_positions(s.model, len(prompt), req.max_new_tokens)
    stream = AnswerStream(s.bus, s.model.tokenizer, req, s.listeners)
    try:
        return await answer.answer(s, req, prompt, stream, deadline, t0)
    finally:
        stream.abort()  # a no-op once closed; on a failure it stops publishing


async def on_config(s: ReceiverState, cfg: schemas.RecomputeConfig) -> None:
    """A profile for a pair with this receiver's exact weights: the newest version per sender
    model wins (whether it fits the holder's weights is checked per request). One naming this
    receiver's model as the sender tells its holder who may read and which E to keep."""
    if s.holder is not None:
        s.holder.on_config(cfg)
    if not policy.accepts(cfg, s.policy_facts):
        if cfg.receiver_model == s.cfg.model_id:
            log.warning("config_ignored", sender_model=cfg.sender_model, version=cfg.profile_version,
                        reason="profiled on other receiver weights or layer count")
        return
    current = s.configs.get(cfg.sender_model)
    if current is None or cfg.profile_version >= current.profile_version:
        await _load_maps(s, cfg)
        s.configs[cfg.sender_model] = cfg
        if current is not None and cfg.profile_version > current.profile_version:
            s.watch.reset(cfg.sender_model)  # a new plan: judged on its own shadows
        s.metrics.profile_version.labels(cfg.sender_model).set(cfg.profile_version)
        log.info("config_loaded", sender_model=cfg.sender_model, version=cfg.profile_version,
                 chosen=cfg.chosen.plan.groups)


async def on_withdrawn(s: ReceiverState, cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
    """A config was withdrawn from the board (`left`: those still on it). The holder keeps only the
    pairs `left` declares. If it was the plan in use for its sender model, the newest config left
    for that model takes its place, else none does: requests reusing that sender's cache get the
    receiver's default (its default group, or full prefill), from the next request on. Either way
    a new plan: the quality watch judges it on its own shadows (a hold on the old one is lifted)."""
    if s.holder is not None:
        grants.unpair_withdrawn(s.holder, left)
    current = s.configs.get(cfg.sender_model)
    if current is None or (current.receiver_model, current.profile_version) != (cfg.receiver_model,
                                                                                cfg.profile_version):
        return
    fallback = max((c for c in left if c.sender_model == cfg.sender_model and policy.accepts(c, s.policy_facts)),
                   key=lambda c: c.profile_version, default=None)
    if fallback is not None:
        await _load_maps(s, fallback)
        s.configs[cfg.sender_model] = fallback
        s.metrics.profile_version.labels(cfg.sender_model).set(fallback.profile_version)
    else:
        del s.configs[cfg.sender_model]
        with contextlib.suppress(KeyError):  # no series: no config in use
            s.metrics.profile_version.remove(cfg.sender_model)
    s.watch.reset(cfg.sender_model)
    log.info("config_withdrawn", sender_model=cfg.sender_model, version=cfg.profile_version,
             now_version=fallback.profile_version if fallback else None,
             chosen=fallback.chosen.plan.groups if fallback else None)


async def _load_maps(s: ReceiverState, cfg: schemas.RecomputeConfig) -> None:
    """Fetch, check and register every SCD maps file `cfg` names; a failure is kept per file (a
    request whose plan needs it falls back to full prefill with that reason), never raised."""
    for sha in sorted(maps_store.referenced([*cfg.frontier, cfg.chosen])):
        try:
            await maps_store.load(s.bus.maps_store(), sha, s.policy_facts.model_sha256, "receiver")
            s.maps_failures.pop(sha, None)
        except DroidMeshError as e:
            s.maps_failures[sha] = f"{e.code}: {e}"
            log.warning("maps_unavailable", sender_model=cfg.sender_model, maps=sha[:12], error=f"{e.code}: {e}")


async def on_endpoint(s: ReceiverState, ev: SenderEndpoint) -> None:
    """A compatible sender announced a cache (its endpoint only): connect ahead so the first pull is warm."""
    if ev.fingerprint_id == s.model.fingerprint.id and ev.transport == s.bulk.transport:
        await s.warm(ev.address)
