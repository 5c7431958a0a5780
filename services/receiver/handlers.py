"""Receiver handlers: one function per subject."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import structlog
from droidmesh.services.receiver import audit
from droidmesh.services.receiver.answer_stream import AnswerStream
from droidmesh.services.receiver.pipeline import (
    ReuseOutcome,
    align_target,
    check_translatable,
    reuse_generate,
    translate_generate,
)
from droidmesh.shared.errors import (
    BadRequestError,
    DeadlineExceededError,
    DroidMeshError,
    OverloadedError,
    PeerUnreachableError,
    ReuseError,
)
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.blocks import reusable_prefix
from droidmesh.shared.kv.partial import Generation
from droidmesh.shared.kv.partial import generate as engine_generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.policy import Reason
from droidmesh.shared.kv.translate import TranslatorMismatchError
from droidmesh.shared.mesh import maps_store
from droidmesh.shared.model import sampling, text
from droidmesh.shared.model.sampling import Sampler, make_sampler
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire import schemas, subjects

if TYPE_CHECKING:
    from droidmesh.services.receiver.config import ReceiverConfig
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


async def _lookup(s: ReceiverState, prompt: list[int], mode: schemas.Mode
                  ) -> tuple[schemas.CacheAvailable | None, Reason | None]:
    """The broker's best holder for `prompt` (under the policy, of a model it has a config for or
    its own, when it has one: a default group can use any), or (None, why not)."""
    usable = [] if mode != "auto" or s.cfg.default_group else sorted({*s.configs, s.cfg.model_id})
    return await _lookup_in(s, prompt, s.model.fingerprint.id, usable)


async def _lookup_in(s: ReceiverState, token_ids: list[int], fingerprint_id: str, models: list[str]
                     ) -> tuple[schemas.CacheAvailable | None, Reason | None]:
    """The broker's best holder of `token_ids` among models of `fingerprint_id` (`models`: [] any)."""
    req = schemas.LookupRequest(token_ids=token_ids, fingerprint_id=fingerprint_id, models=models)
    try:
        data = await s.bus.request(subjects.BROKER_LOOKUP, schemas.encode(req), timeout=s.cfg.lookup_timeout_s)
    except TimeoutError as e:
        return None, ("broker_unavailable", f"broker: {e}")
    try:
        reply = schemas.decode(data, schemas.LookupReply)
    except DroidMeshError:
        err = schemas.decode(data, schemas.ErrorReply)
        return None, ("broker_error", f"broker error {err.code}: {err.message}")
    s.metrics.lookups.labels("hit" if reply.holder is not None else "miss").inc()
    if reply.holder is None:
        return None, ("no_cache", "no cached prefix")
    return reply.holder, None


async def generate(s: ReceiverState, req: schemas.GenerateRequest) -> schemas.GenerateReply:
    """Answer over a shared context: reuse a sender's cache per the pair's plan, else full prefill.

    The request is checked first (`check`); tokens are chosen by its sampling and the
    answer ends before its first stop string; with a `stream_subject` the answer is also
    published there as it is decoded (`services/receiver/answer_stream.py`), every chunk before the reply.
    Duplicates (a client's retry, or NATS redelivering after a reconnect: the same id and the same
    bytes) share one answer: the first copy computes it (and streams it), later copies await the
    same result. Another request that reuses a known id is a different key: it gets its own answer.
    Past `max_queued_requests` held at once, a new request is refused at once ("overloaded")."""
    arrived = time.monotonic()  # the budget counts from here: no clock is compared with the client's
    key = (req.request_id, hashlib.blake2b(schemas.encode(req), digest_size=16).digest())
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
        reply = await _generate(s, req, arrived)
        fut.set_result(reply)
        return reply
    except BaseException as e:
        s.replies.pop(key, None)  # a failed attempt may be retried afresh
        fut.set_exception(e)
        fut.exception()  # mark retrieved: duplicates waiting on it re-raise it themselves
        raise
    finally:
        s.inflight -= 1


def deadline_of(req: schemas.GenerateRequest, arrived: float, default_s: float) -> float:
    """The request's deadline on this host's monotonic clock: `budget_s` after it arrived (immune
    to clock skew between client and receiver), else its absolute `deadline`, else the default."""
    if not math.isfinite(req.budget_s) or req.budget_s < 0:
        raise BadRequestError(f"budget_s must be a finite number of seconds >= 0, got {req.budget_s}")
    if req.budget_s > 0:
        return arrived + req.budget_s
    if req.deadline:
        if not math.isfinite(req.deadline):
            raise BadRequestError(f"deadline must be finite unix seconds, got {req.deadline}")
        return arrived + (req.deadline - time.time())
    return arrived + default_s


def _check_deadline(deadline: float, stage: str) -> None:
    late = time.monotonic() - deadline
    if late >= 0:
        raise DeadlineExceededError(f"deadline passed {late:.3f}s {stage}; dropped")


async def _generate(s: ReceiverState, req: schemas.GenerateRequest, arrived: float) -> schemas.GenerateReply:
    t0 = time.perf_counter()
    deadline = deadline_of(req, arrived, s.cfg.request_timeout_s)
    _check_deadline(deadline, "before start")
    check(req, s.cfg)
    prompt = prompt_ids(s.model.tokenizer, req)
    check_positions(s.model, len(prompt), req.max_new_tokens)
    stream = AnswerStream(s.bus, s.model.tokenizer, req)
    try:
        return await _answer(s, req, prompt, stream, deadline, t0)
    finally:
        stream.abort()  # a no-op once closed; on a failure it stops publishing


def _sampler(s: ReceiverState, req: schemas.GenerateRequest) -> Sampler:
    """A fresh sampler per attempt: a fallback after a failed reuse replays the same draws."""
    sp = req.sampling
    return make_sampler(sp.temperature, sp.top_p, sp.seed, device=s.model.device)


async def _answer(s: ReceiverState, req: schemas.GenerateRequest, prompt: list[int], stream: AnswerStream,
                  deadline: float, t0: float) -> schemas.GenerateReply:
    stamps: dict[str, float] = {"start": t0}
    holder, miss = None, None
    if req.mode != "full_prefill":
        holder, miss = await _lookup(s, prompt, req.mode)
        stamps["lookup_done"] = time.perf_counter()
        _check_deadline(deadline, "after the lookup")
        if holder is not None and not s.breaker.allow(holder.sender_id):
            miss = ("holder_open_circuit", f"holder_open_circuit: sender {holder.sender_id} failed {s.cfg.breaker_failures} pulls in a row "
                                           f"(or could not be reached); skipped for {s.cfg.breaker_cooldown_s:g}s")
            holder = None
    online = policy.Online(tokens=len(prompt), queued=s.inflight - 1,
                           bandwidth_bps=s.bandwidth_of(holder.sender_id) if holder else None,
                           slo_s=req.ttft_slo_ms / 1e3 if req.ttft_slo_ms > 0 else None,
                           reused_tokens=reusable_prefix(holder.token_ids, prompt) if holder else None,
                           reuse_overhead_s=s.reuse_overhead_s, prefill_scale=s.calibration.scale(policy.PREFILL_KIND),
                           reuse_scale=s.calibration.scale(policy.reuse_kind(holder.model_id)) if holder else 1.0,
                           queue_wait_s=s.queue_wait.wait(s.inflight - 1))
    decided = time.perf_counter()
    decision = policy.decide(req.mode, holder, miss, policy.config_for(holder, s.policy_facts, s.configs) if holder else None,
                             s.policy_facts, online)
    decision, assignment = audit.assign(s, audit.hold(s, holder, decision), req.mode)
    decision_ms = (time.perf_counter() - decided) * 1e3
    plan, path, reason = decision.plan, decision.path, decision.reason
    missing = _maps_missing(s, decision)
    if missing is not None:  # the plan's codes cannot be decoded here: the receiver's own prefill, and why
        plan, path, reason = ReusePlan.full_prefill(), "fallback", missing
    if miss is not None and miss[0] == "holder_open_circuit":
        path = "fallback"  # a holder was found and skipped: not a plain miss
    bytes_pulled, gen, held = 0, None, 0.0  # held: seconds this request held the torch thread
    if plan.mode != "full_prefill" and holder is not None:
        try:
            out = await _reuse(s, holder, decision, prompt, req, stream, deadline)
            gen, bytes_pulled, held = out.generation, out.bytes_pulled, out.busy_s
            stamps.update(out.stamps)
            pulled_at = out.stamps.get("grant_done", out.stamps["pull_start"])
            s.observe_pull(holder.sender_id, bytes_pulled, out.stamps["pull_done"] - pulled_at,
                           pulled_at - out.stamps["pull_start"])
        except ReuseError as e:
            if stream.tokens:  # decoding had begun (chunks may be out): a second answer would garble it
                raise
            path, reason = "fallback", (e.code, f"{e.code}: {e}")
            log.warning("reuse_fallback", request_id=req.request_id, reason=reason[1])
    elif holder is not None:
        s.breaker.release(holder.sender_id)  # allowed a probe the plan did not use: the next request probes
    if gen is None and holder is None and req.mode == "auto" and req.chat is None and (
            s.translations or s.translator_failures):
        try:
            translated = await _translate(s, req, prompt, stream, deadline)
        except ReuseError as e:
            if stream.tokens:
                raise
            path, reason = "fallback", (e.code, f"{e.code}: {e}")
            log.warning("translate_fallback", request_id=req.request_id, reason=reason[1])
        else:
            if translated is not None:
                holder, out = translated
                gen, bytes_pulled, held, path = out.generation, out.bytes_pulled, out.busy_s, "translate"
                stamps.update(out.stamps)
                plan = ReusePlan.full_reuse()
    if gen is None:  # no cache, no config, forced, or a fault: the receiver's own full prefill
        _check_deadline(deadline, "before computing")
        sampler = _sampler(s, req)

        def full_prefill() -> Generation:
            stamps["engine_start"] = time.perf_counter()  # in the worker: queueing is not compute
            return engine_generate(s.model, prompt, ReusePlan.full_prefill(), max_new_tokens=req.max_new_tokens,
                                   eos_token_id=s.eos_token_id, sampler=sampler, on_token=stream.on_token,
                                   deadline=deadline)

        stamps["queued"] = time.perf_counter()
        gen = await s.run_torch(full_prefill, deadline=deadline)
        held += gen.total_s
        stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
        plan = ReusePlan.full_prefill()
    answer = await stream.close()  # every chunk is published before the reply goes out
    finish: schemas.FinishReason = "stop" if stream.text.stopped else gen.finish_reason
    done = time.perf_counter()
    stages_ms = {k: round((v - t0) * 1e3, 3) for k, v in sorted(stamps.items(), key=lambda kv: kv[1])}
    stages_ms["done"] = round((done - t0) * 1e3, 3)
    ttft_ms = (stamps["first_token"] - t0) * 1e3
    shown = reason if path in ("fallback", "full_prefill") else None
    why = shown[1] if shown is not None else None
    _record(s, path, shown[0] if shown is not None else "", ttft_ms, stages_ms, bytes_pulled, stamps)
    predicted_ms = {k: round(v * 1e3, 3) for k, v in decision.predicted_s.items()}
    waited = max(0.0, stamps.get("engine_start", decided) - decided)  # for the compute thread, behind others
    s.queue_wait.observe(held)
    audit.calibrate(s, decision, path, holder, ttft_ms / 1e3 - waited)
    audit.count_relay(s, decision, assignment, path, online, ttft_ms / 1e3)
    shadowed = (assignment in ("treatment", "blind") and path in ("partial", "full_reuse") and s.cfg.shadow_share > 0
                and req.sampling.temperature == 0 and s.rng.random() < s.cfg.shadow_share)
    if shadowed:
        s.background(audit.shadow(s, req.request_id, holder.model_id if holder else "", req.context, req.question,
                                  prompt, gen.tokens), f"shadow-{req.request_id}")
    label = f"translated from {holder.model_id}" if path == "translate" and holder is not None else plan.label()
    log.info("request", request_id=req.request_id, path=path, plan=label, reason=why,
             assignment=assignment, holdout_share=s.cfg.holdout_share, blind_share=s.cfg.blind_share, shadowed=shadowed,
             predicted_ttft_ms=_ms(decision.predicted_ttft_s),
             decision_ms=round(decision_ms, 4),
             options_ms=predicted_ms, reused_fraction=round(gen.prefill.reused_tokens / max(1, len(prompt)), 4),
             reusable_fraction=round((online.reused_tokens or 0) / max(1, len(prompt)), 4),
             sender_model=holder.model_id if holder else None, receiver_model=s.cfg.model_id,
             context_tokens=len(holder.token_ids) if holder else 0, queued=online.queued,
             topology=_topology(holder) if holder else None,
             prompt_tokens=len(prompt), reused_tokens=gen.prefill.reused_tokens, bytes_pulled=bytes_pulled,
             new_tokens=len(gen.tokens), finish_reason=finish, chunks=stream.published,
             chunk_failures=stream.failed, ttft_ms=round(ttft_ms, 3), stages_ms=stages_ms)
    return schemas.GenerateReply(
        request_id=req.request_id, text=answer, token_ids=gen.tokens, path=path,
        fallback_reason=why, plan=label,
        sender_id=holder.sender_id if holder is not None and path != "full_prefill" else None,
        bytes_pulled=bytes_pulled, ttft_ms=ttft_ms, stages_ms=stages_ms, served_by=s.cfg.receiver_id,
        prompt_tokens=len(prompt), reused_tokens=gen.prefill.reused_tokens, finish_reason=finish,
        codec=decision.codec if plan.mode != "full_prefill" else "",
        predicted_ttft_ms=_ms(decision.predicted_ttft_s) or 0.0, options_ms=predicted_ms,
    )


def _topology(holder: schemas.CacheAvailable) -> str:
    """"same_host" when the holder's bulk channel is a same-host one (shm, inproc) or its address a
    loopback one, else "remote" (the audit's stratum)."""
    if holder.transport in ("shm", "inproc"):
        return "same_host"
    host = holder.address.rsplit(":", 1)[0].strip("[]")
    return "same_host" if host in ("127.0.0.1", "localhost", "::1") else "remote"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _maps_missing(s: ReceiverState, decision: policy.Decision) -> policy.Reason | None:
    """Why `decision`'s lowrank codes cannot be decoded here (their maps not loaded), or None."""
    if decision.plan.mode == "full_prefill" or decision.codec != codecs.LOWRANK.name:
        return None
    sha = str(decision.codec_params.get(codecs.MAPS_PARAM, ""))
    if codecs.LOWRANK.has_maps(sha):
        return None
    why = s.maps_failures.get(sha, "not fetched yet")
    return "maps_unavailable", f"maps_unavailable: SCD maps {sha[:12]}... not loaded ({why})"


async def _translate(s: ReceiverState, req: schemas.GenerateRequest, prompt: list[int], stream: AnswerStream,
                     deadline: float) -> tuple[schemas.CacheAvailable, ReuseOutcome] | None:
    """The translated path: the first source model with a loaded translator whose holder caches
    this context (looked up in the source's own tokens) answers; None when no holder exists. Why
    a found holder could not be used is raised (`ReuseError`) when no other one served; so is why
    the translators were refused, when none loaded. Tokenizing runs off the event loop."""
    unusable: ReuseError | None = None
    for model_id, t in s.translations.items():
        s_ids, s_spans = await asyncio.to_thread(text.context_spans, t.source_tokenizer, req.context)
        holder, _ = await _lookup_in(s, s_ids, t.translator.source_fp.id, [model_id])
        _check_deadline(deadline, "after the translated lookup")
        if holder is None:
            continue
        try:
            check_translatable(holder, t.translator, s_ids, s.model, s.bulk.transport)
            tokenized = await asyncio.to_thread(align_target, s.model.tokenizer, req.context, s_ids, s_spans)
        except ReuseError as e:
            unusable = e
            continue
        if prompt[:len(tokenized.target_ids)] != tokenized.target_ids:
            continue  # the receiver's context tokens, with offsets, must be the prompt's own prefix
        if not s.breaker.allow(holder.sender_id):
            continue
        out = await _pulled(s, holder, translate_generate(
            s, holder, t.translator, tokenized, prompt, req.max_new_tokens,
            timeout_s=max(0.01, min(s.cfg.reuse_timeout_s, deadline - time.monotonic())), sampler=_sampler(s, req),
            on_token=stream.on_token, deadline=deadline))
        return holder, out
    if unusable is not None:
        raise unusable
    if not s.translations and s.translator_failures:
        raise TranslatorMismatchError("; ".join(s.translator_failures))
    return None


async def _reuse(s: ReceiverState, holder: schemas.CacheAvailable, decision: policy.Decision, prompt: list[int],
                 req: schemas.GenerateRequest, stream: AnswerStream, deadline: float) -> ReuseOutcome:
    """`reuse_generate`, its outcome counted by the holder's circuit breaker: a pull that fails
    (any `ReuseError`) is a failure, one that cannot even connect opens the circuit at once."""
    return await _pulled(s, holder, reuse_generate(
        s, holder, decision, prompt, req.max_new_tokens,
        timeout_s=max(0.01, min(s.cfg.reuse_timeout_s, deadline - time.monotonic())), sampler=_sampler(s, req),
        on_token=stream.on_token, deadline=deadline))


async def _pulled(s: ReceiverState, holder: schemas.CacheAvailable, pulling: Awaitable[ReuseOutcome]) -> ReuseOutcome:
    """`pulling` (a pull from `holder` and the engine run on it), its outcome counted by the
    holder's circuit breaker: a pull that fails (any `ReuseError`) is a failure, one that cannot
    even connect opens the circuit at once."""
    sid = holder.sender_id
    try:
        out = await pulling
    except ReuseError as e:
        if s.breaker.failure(sid, hard=unreachable(e)):
            s.metrics.requests.labels("breaker", "holder_open_circuit").inc()
            log.warning("holder_circuit_open", sender_id=sid, reason="holder_open_circuit", error=f"{e.code}: {e}",
                        cooldown_s=s.cfg.breaker_cooldown_s)
        raise
    except BaseException:
        s.breaker.release(sid)  # cancelled or dropped: says nothing about the holder
        raise
    s.breaker.success(sid)
    return out


def unreachable(e: BaseException) -> bool:
    """Whether a failed reuse could not even reach its holder: a `PeerUnreachableError` itself, or
    as the cause of what the engine raised (a layer that will not arrive because the pull never connected)."""
    seen: BaseException | None = e
    for _ in range(8):  # a cause chain is short; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, PeerUnreachableError):
            return True
        seen = seen.__cause__
    return False


def _record(s: ReceiverState, path: str, reason: str, ttft_ms: float, stages_ms: dict[str, float],
            bytes_pulled: int, stamps: dict[str, float]) -> None:
    m = s.metrics
    m.requests.labels(path, reason).inc()
    m.ttft.labels(path).observe(ttft_ms / 1e3)
    for stage, ms in stages_ms.items():
        if not stage.startswith("arrived_"):  # per-layer arrivals would explode the label set
            m.stage.labels(stage).observe(ms / 1e3)
    if bytes_pulled:
        m.bytes_pulled.inc(bytes_pulled)
        m.ucx_throughput.observe(bytes_pulled / max(1e-9, stamps["pull_done"] - stamps["pull_start"]))


async def on_config(s: ReceiverState, cfg: schemas.RecomputeConfig) -> None:
    """A profile for a pair with this receiver's exact weights: the newest version per sender
    model wins (whether it fits the holder's weights is checked per request)."""
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


async def on_available(s: ReceiverState, ev: schemas.CacheAvailable) -> None:
    """A compatible sender announced a cache: connect ahead so the first pull is warm."""
    if ev.fingerprint_id == s.model.fingerprint.id and ev.transport == s.bulk.transport:
        await s.warm(ev.address)


# -- what a request may ask ------------------------------------------------------------------
# What a generate request may ask of a receiver, checked before any work, and its prompt.
#
# `check` raises `BadRequestError` with a one-line message naming the first bad field (the client
# gets it as an ErrorReply). The limits bound what one request can cost: decode steps
# (`max_new_tokens_limit`), tokenization (`max_prompt_chars`), stop matching (4 strings of 64
# characters) and where chunks may go (an inbox subject only: a request can never make a receiver
# publish onto a mesh subject such as `dm.cache.available`).
MAX_CHAT_MESSAGES = 64
MAX_STREAM_SUBJECT = 128


def check(req: schemas.GenerateRequest, cfg: ReceiverConfig) -> None:
    limit = cfg.max_new_tokens_limit
    if not 1 <= req.max_new_tokens <= limit:
        raise BadRequestError(f"max_new_tokens must be in [1, {limit}] (max_new_tokens_limit), got {req.max_new_tokens}")
    sampling.check_sampling(req.sampling.temperature, req.sampling.top_p, req.sampling.seed)
    text.check_stop(req.sampling.stop)
    check_stream_subject(req.stream_subject)
    chars = len(req.context) + len(req.question)
    if req.chat is not None:
        if not 1 <= len(req.chat) <= MAX_CHAT_MESSAGES:
            raise BadRequestError(f"chat must hold 1..{MAX_CHAT_MESSAGES} messages, got {len(req.chat)}")
        if req.context or req.question:
            raise BadRequestError("a chat request carries its text in chat; context and question must be empty")
        chars = sum(len(m.content) for m in req.chat)
    if chars > cfg.max_prompt_chars:
        raise BadRequestError(f"prompt of {chars} characters exceeds max_prompt_chars={cfg.max_prompt_chars}")


def check_positions(model: object, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse up front a prompt the model has no positions for (`max_position_embeddings`):
    prompt + new tokens must fit, else the request would only run long and fail late."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + max_new_tokens > limit:
        raise BadRequestError(f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the "
                              f"model's {limit} positions (max_position_embeddings); shorten the context")


# `_INBOX.` + tokens, or a user's own `_INBOX_<user>.` + tokens (subjects.inbox_prefix); no
# wildcards or spaces. Which user's inbox a receiver may publish into is NATS permissions' call.
_STREAM_SUBJECT = re.compile(rf"^{subjects.INBOX_PREFIX}(_[A-Za-z0-9_-]+)?(\.[^.*> \t\r\n]+)+$")


def check_stream_subject(subject: str) -> None:
    """"" (no streaming) or a concrete inbox subject (see `_STREAM_SUBJECT`)."""
    if not subject:
        return
    if len(subject) > MAX_STREAM_SUBJECT:
        raise BadRequestError(f"stream_subject longer than {MAX_STREAM_SUBJECT} characters")
    if not _STREAM_SUBJECT.match(subject):
        raise BadRequestError(f"stream_subject must be an inbox subject (_INBOX. or _INBOX_<user>.), got {subject[:64]!r}")


def prompt_ids(tokenizer: object, req: schemas.GenerateRequest) -> list[int]:
    """The request's prompt tokens: the chat rendered (`text.chat_prompt_ids`), or context +
    question (a completions-style prompt is `context=prompt, question=""`: its ids are exactly
    `context_ids(prompt)`, so a sender's cache of any token prefix of it is found)."""
    if req.chat is not None:
        return text.chat_prompt_ids(tokenizer, req.chat)
    ctx_ids, q_ids = text.prompt_ids(tokenizer, req.context, req.question)
    return ctx_ids + q_ids
