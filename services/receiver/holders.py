"""Finding a holder of a prompt's cache and pulling from it: the broker lookup, the reuse and
translated pulls under the per-holder circuit breaker, and why a plan's codes cannot be decoded.

Called by `answer.py` on the event loop, once per request and attempt. Lookups and pulls await
the bus and the bulk channel (bounded by `lookup_timeout_s`, `reuse_timeout_s` and the request's
deadline); the engine runs on the torch thread (`pipeline.py`); tokenizing for a translated pair
runs in `asyncio.to_thread`. The broker's reply is decoded like any message; the holder it names
is not trusted to serve: its fingerprint, layers and tokens are checked before or during the pull,
and a holder that cannot serve raises a `ReuseError` (counted by the breaker), which the caller
turns into a fallback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from droidmesh.services.receiver.checks import check_deadline
from droidmesh.services.receiver.pipeline import (
    ReuseOutcome,
    Tokenized,
    Translation,
    align_target,
    check_translatable,
    local_generate,
    reuse_generate,
    translate_generate,
)
from droidmesh.shared.errors import DroidMeshError, PeerUnreachableError, ReuseError
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.policy import Reason
from droidmesh.shared.kv.translate import TranslatorMismatchError
from droidmesh.shared.model import text
from droidmesh.shared.model.sampling import MAX_SEED, Sampler, make_sampler
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.hashing import PUBLIC, common_prefix

if TYPE_CHECKING:
    from droidmesh.services.receiver.answer_stream import AnswerStream
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


async def lookup(s: ReceiverState, prompt: list[int], mode: schemas.Mode, scope: str
                 ) -> tuple[schemas.CacheAvailable | None, Reason | None]:
    """The broker's best holder for `prompt` (under the policy, of a model it has a config for or
    its own, when it has one: a default group can use any), or (None, why not)."""
    usable = [] if mode != "auto" or s.cfg.default_group else sorted({*s.configs, s.cfg.model_id})
    if s.holder is None:
        return await lookup_in(s, prompt, s.model.fingerprint.id, usable, scope)
    if mode != "auto":  # an explicit plan mode asks to reuse another holder's cache, not this receiver's own KV
        return await lookup_in(s, prompt, s.model.fingerprint.id, usable, scope, exclude_sender=s.holder.id)
    # What this process holds is found here, without waiting for the broker to index it (a request
    # right after the one that computed it); the broker is asked only when another holder could do better.
    local, matched = s.holder.match(prompt, s.model.fingerprint.id, usable, scope)
    if local is not None and matched >= len(prompt) - 1:  # as much as any reuse can take: one token is computed
        s.metrics.lookups.labels("hit").inc()
        return local, None
    found, miss = await lookup_in(s, prompt, s.model.fingerprint.id, usable, scope, exclude_sender=s.holder.id)
    if local is not None and (found is None or common_prefix(found.token_ids, prompt) <= matched):
        return local, None
    return found, miss


async def lookup_in(s: ReceiverState, token_ids: list[int], fingerprint_id: str, models: list[str], scope: str,
                    exclude_sender: str | None = None) -> tuple[schemas.CacheAvailable | None, Reason | None]:
    """The broker's best holder of `token_ids` among models of `fingerprint_id` (`models`: [] any),
    of the request's `scope` or public: a holder of another scope is never used, whatever the
    broker says (the reply then reads as a miss, so it tells the client nothing)."""
    req = schemas.LookupRequest(token_ids=token_ids, fingerprint_id=fingerprint_id, models=models, scope=scope,
                                exclude_sender=exclude_sender)
    try:
        data = await s.bus.request(subjects.BROKER_LOOKUP, schemas.encode(req), timeout=s.cfg.lookup_timeout_s)
    except TimeoutError as e:
        return None, ("broker_unavailable", f"broker: {e}")
    try:
        reply = schemas.decode(data, schemas.LookupReply)
    except DroidMeshError:
        err = schemas.decode(data, schemas.ErrorReply)
        return None, ("broker_error", f"broker error {err.code}: {err.message}")
    if reply.holder is not None and reply.holder.scope not in (scope, PUBLIC):
        log.warning("holder_out_of_scope", sender_id=reply.holder.sender_id, scope=scope)
        reply = schemas.LookupReply(holder=None, matched_tokens=0)
    s.metrics.lookups.labels("hit" if reply.holder is not None else "miss").inc()
    if reply.holder is None:
        return None, ("no_cache", "no cached prefix")
    return reply.holder, None


def maps_missing(s: ReceiverState, decision: policy.Decision) -> policy.Reason | None:
    """Why `decision`'s lowrank codes cannot be decoded here (their maps not loaded), or None."""
    if decision.plan.mode == "full_prefill" or decision.codec != codecs.LOWRANK.name:
        return None
    sha = str(decision.codec_params.get(codecs.MAPS_PARAM, ""))
    if codecs.LOWRANK.has_maps(sha):
        return None
    why = s.maps_failures.get(sha, "not fetched yet")
    return "maps_unavailable", f"maps_unavailable: SCD maps {sha[:12]}... not loaded ({why})"


def sampler_for(s: ReceiverState, req: GenerateRequest, index: int = 0) -> Sampler:
    """A fresh sampler per attempt: a fallback after a failed reuse replays the same draws. Sample
    `index` of a request with a seed draws from seed + index (its own stream of draws)."""
    sp = req.sampling
    seed = None if sp.seed is None else (sp.seed + index) % (MAX_SEED + 1)
    return make_sampler(sp.temperature, sp.top_p, seed, device=s.model.device)


def samples_for(s: ReceiverState, req: GenerateRequest) -> list[tuple[Sampler, Callable[[int], bool]]]:
    """Samples 2..n of the request: each its own sampler, and decoding that ends at a stop string
    (its text is rebuilt from its tokens for the reply: `reply.sample_text`)."""
    out: list[tuple[Sampler, Callable[[int], bool]]] = []
    for i in range(1, req.n):
        out.append((sampler_for(s, req, i), _stops_at(text.TextStream(s.model.tokenizer, req.sampling.stop))))
    return out


def _stops_at(stops: text.TextStream) -> Callable[[int], bool]:
    return lambda token: not stops.push(token)[1]


async def reuse(s: ReceiverState, holder: schemas.CacheAvailable, decision: policy.Decision, prompt: list[int],
                req: GenerateRequest, stream: AnswerStream, deadline: float) -> ReuseOutcome:
    """`reuse_generate`, its outcome counted by the holder's circuit breaker: a pull that fails
    (any `ReuseError`) is a failure, one that cannot even connect opens the circuit at once."""
    return await _pulled(s, holder, reuse_generate(
        s, holder, decision, prompt, req.max_new_tokens, timeout_s=_timeout_s(s, deadline),
        sampler=sampler_for(s, req), on_token=stream.on_token, deadline=deadline, logprobs=req.sampling.logprobs,
        samples=samples_for(s, req)))


async def reuse_held(s: ReceiverState, holder: schemas.CacheAvailable, decision: policy.Decision,
                     prompt: list[int], req: GenerateRequest, stream: AnswerStream, deadline: float
                     ) -> ReuseOutcome:
    """`local_generate`: the plan over a context this receiver holds itself (no pull, no breaker)."""
    return await local_generate(s, holder, decision, prompt, req.max_new_tokens, req.scope,
                                sampler=sampler_for(s, req), on_token=stream.on_token, deadline=deadline,
                                logprobs=req.sampling.logprobs, samples=samples_for(s, req))


async def translate(s: ReceiverState, req: GenerateRequest, prompt: list[int], stream: AnswerStream,
                    deadline: float) -> tuple[schemas.CacheAvailable, ReuseOutcome] | None:
    """The translated path: the first source model with a loaded translator whose holder caches
    this context (looked up in the source's own tokens) answers; None when no holder exists. Why
    a found holder could not be used is raised (`ReuseError`) when no other one served; so is why
    the translators were refused, when none loaded. Tokenizing runs off the event loop."""
    unusable: ReuseError | None = None
    for model_id, t in s.translations.items():
        s_ids, s_spans = await asyncio.to_thread(text.context_spans, t.source_tokenizer, req.context)
        holder, _ = await lookup_in(s, s_ids, t.translator.source_fp.id, [model_id], req.scope)
        check_deadline(deadline, "after the translated lookup")
        if holder is None:
            continue
        try:
            tokenized = await _aligned(s, holder, t, req.context, s_ids, s_spans)
        except ReuseError as e:
            unusable = e
            continue
        # The receiver's context tokens, with offsets, must be the prompt's own prefix.
        if prompt[:len(tokenized.target_ids)] != tokenized.target_ids or not s.breaker.allow(holder.sender_id):
            continue
        out = await _pulled(s, holder, translate_generate(
            s, holder, t.translator, tokenized, prompt, req.max_new_tokens, timeout_s=_timeout_s(s, deadline),
            sampler=sampler_for(s, req), on_token=stream.on_token, deadline=deadline, logprobs=req.sampling.logprobs,
            samples=samples_for(s, req)))
        return holder, out
    if unusable is not None:
        raise unusable
    if not s.translations and s.translator_failures:
        raise TranslatorMismatchError("; ".join(s.translator_failures))
    return None


async def _aligned(s: ReceiverState, holder: schemas.CacheAvailable, t: Translation, context: str,
                   s_ids: list[int], s_spans: list[Any]) -> Tokenized:
    """`context` in both tokenizations, once `holder` is known to serve the translator (else a
    `ReuseError`, before any pull). The receiver's tokenizing runs off the event loop."""
    check_translatable(holder, t.translator, s_ids, s.model, s.bulk.transport)
    return await asyncio.to_thread(align_target, s.model.tokenizer, context, s_ids, s_spans)


def _timeout_s(s: ReceiverState, deadline: float) -> float:
    """A pull's bound: `reuse_timeout_s`, cut to what is left of the request's deadline."""
    return max(0.01, min(s.cfg.reuse_timeout_s, deadline - time.monotonic()))


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
