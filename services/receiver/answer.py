"""Answering one checked generate request: lookup -> plan -> pull and recompute (or translate, or
the receiver's own prefill) -> decode -> reply.

Called by `handlers.generate` on the event loop, once per request (duplicates never get here).
Awaits the broker lookup and pulls (`holders.py`), and the engine on the torch thread; never
blocks the loop itself. Trusts the request to have passed `checks.py`. The order of the ways
tried is fixed:
  1. `_route`: the broker's holder (skipped when its circuit is open), the policy's decision on
     what it knows now, the audit's assignment (`relay_watch.assign`, `relay_watch.hold`);
  2. `_try_reuse`: the plan's pull from that holder while recomputing (or, when the holder is this
     receiver itself, the plan over its own store, in process); a `ReuseError` before the first
     token falls back, one after it fails the request (chunks may be out);
  3. `_try_translate`: when the lookup left no holder (a miss, or one skipped), a translated pair's;
  4. `_own_prefill`: whatever is left, the receiver's own full prefill, which it then holds
     (`pipeline.offer`, when `hold` is on) for the next request over the same text;
then `reply.finish` records, feeds the audit and builds the reply. A streamed request whose
listener left meanwhile (`answer_stream.ListenerWatch`) stopped decoding early: it is recorded
and logged as cancelled, then fails `client_gone` instead of being answered.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import structlog

from droidmesh.services.receiver import holders, pipeline, relay_watch, reply
from droidmesh.services.receiver.answer_stream import ClientGoneError
from droidmesh.services.receiver.checks import check_deadline
from droidmesh.shared.errors import ReuseError
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.blocks import reusable_prefix
from droidmesh.shared.kv.partial import Generation, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.policy import Reason
from droidmesh.shared.service.engine import drive_engine
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest

if TYPE_CHECKING:
    from droidmesh.services.receiver.answer_stream import AnswerStream
    from droidmesh.services.receiver.pipeline import ReuseOutcome
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


@dataclasses.dataclass
class Job:
    """One request being answered: what it asked, its prompt tokens, where its answer streams,
    its deadline (time.monotonic()) and its stages (absolute time.perf_counter(); "start" first)."""

    req: GenerateRequest
    prompt: list[int]
    stream: AnswerStream
    deadline: float
    stamps: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Route:
    """What the lookup found and the policy chose, before anything was pulled."""

    holder: schemas.CacheAvailable | None  # None: a miss, or a holder whose circuit is open
    miss: Reason | None  # why there is no holder
    online: policy.Online  # what the policy knew of this moment
    decision: policy.Decision  # after the audit's assignment
    assignment: str  # "treatment", "control", "blind" or "ineligible"
    decided: float  # time.perf_counter() when the policy was asked
    decision_ms: float  # how long deciding took


@dataclasses.dataclass
class Served:
    """How the request is served, updated as each way is tried (reuse, translation, own prefill)."""

    plan: ReusePlan
    path: schemas.Path  # the reply's path
    reason: Reason | None  # why not relayed (shown only on "fallback" and "full_prefill")
    holder: schemas.CacheAvailable | None  # the route's holder, or the translated pair's
    gen: Generation | None = None  # the answer, once one way produced it
    bytes_pulled: int = 0
    held: float = 0.0  # seconds this request held the torch thread


async def answer(s: ReceiverState, req: GenerateRequest, prompt: list[int], stream: AnswerStream,
                 deadline: float, t0: float) -> schemas.GenerateReply:
    """The reply to a checked request (`t0`: time.perf_counter() when it was taken up), by the
    steps of the module docstring. Raises what fails it: a deadline, a fault after decoding began."""
    job = Job(req, prompt, stream, deadline, {"start": t0})
    route = await _route(s, job)
    served = _first_choice(s, route)
    await _try_reuse(s, job, route, served)
    if served.gen is None and _may_translate(s, req, route):
        await _try_translate(s, job, served)
    gen = served.gen if served.gen is not None else await _own_prefill(s, job, served)
    text = await stream.close()  # every chunk is published before the reply goes out
    out = reply.finish(s, job, route, served, gen, text)
    if stream.gone:  # logged as cancelled above; no answer is remembered for a retry to share
        raise ClientGoneError(f"the stream's listener left; decoding stopped after {len(gen.tokens)} of "
                              f"{req.max_new_tokens} tokens")
    return out


async def _route(s: ReceiverState, job: Job) -> Route:
    """Step 1 of the module docstring."""
    holder, miss = None, None
    if job.req.mode != "full_prefill":
        holder, miss = await _find_holder(s, job)
    online = _online(s, job, holder)
    decided = time.perf_counter()
    config = policy.config_for(holder, s.policy_facts, s.configs) if holder else None
    decision = policy.decide(job.req.mode, holder, miss, config, s.policy_facts, online)
    decision, assignment = relay_watch.assign(s, relay_watch.hold(s, holder, decision), job.req.mode)
    return Route(holder, miss, online, decision, assignment, decided, (time.perf_counter() - decided) * 1e3)


async def _find_holder(s: ReceiverState, job: Job) -> tuple[schemas.CacheAvailable | None, Reason | None]:
    """The broker's holder, unless its circuit is open (then none, and why)."""
    holder, miss = await holders.lookup(s, job.prompt, job.req.mode, job.req.scope)
    job.stamps["lookup_done"] = time.perf_counter()
    check_deadline(job.deadline, "after the lookup")
    if holder is not None and not s.breaker.allow(holder.sender_id):
        cfg = s.cfg
        return None, ("holder_open_circuit",
                      f"holder_open_circuit: sender {holder.sender_id} failed {cfg.breaker_failures} pulls in a row "
                      f"(or could not be reached); skipped for {cfg.breaker_cooldown_s:g}s")
    return holder, miss


def _online(s: ReceiverState, job: Job, holder: schemas.CacheAvailable | None) -> policy.Online:
    """What the policy weighs now: the prompt, the queue, the holder's link and the calibration."""
    prompt, req, queued = job.prompt, job.req, s.inflight - 1  # this request is counted in inflight
    # Requests decoding in the batch no longer hold the thread a prefill each: what waits ahead is
    # the prefills queued, plus a decode step between each two of this request's prefill jobs.
    prefilling = max(0, queued - s.batcher.active)
    return policy.Online(
        tokens=len(prompt), queued=queued,
        bandwidth_bps=s.bandwidth_of(holder) if holder else None,
        slo_s=req.ttft_slo_ms / 1e3 if req.ttft_slo_ms > 0 else None,
        reused_tokens=reusable_prefix(holder.token_ids, prompt) if holder else None,
        reuse_overhead_s=s.reuse_overhead_s, prefill_scale=s.calibration.scale(policy.PREFILL_KIND),
        reuse_scale=s.calibration.scale(policy.reuse_kind(holder.model_id)) if holder else 1.0,
        queue_wait_s=s.queue_wait.wait(prefilling) + s.batcher.prefill_delay(s.model.num_layers))


def _first_choice(s: ReceiverState, route: Route) -> Served:
    """The decision as it stands before any pull: the receiver's own prefill when the plan's codes
    cannot be decoded here; "fallback" (not a plain miss) when a holder was found and skipped."""
    d = route.decision
    served = Served(d.plan, d.path, d.reason, route.holder)
    missing = holders.maps_missing(s, d)
    if missing is not None:
        served.plan, served.path, served.reason = ReusePlan.full_prefill(), "fallback", missing
    if route.miss is not None and route.miss[0] == "holder_open_circuit":
        served.path = "fallback"
    return served


async def _try_reuse(s: ReceiverState, job: Job, route: Route, served: Served) -> None:
    """Step 2: pull from the route's holder as the plan says; its throughput feeds the policy."""
    holder = route.holder
    if holder is None:
        return
    if served.plan.mode == "full_prefill":
        s.breaker.release(holder.sender_id)  # allowed a probe the plan did not use: the next request probes
        return
    local = s.holds(holder)  # this receiver's own held context: read in process, nothing pulled
    try:
        reuse = holders.reuse_held if local else holders.reuse
        out = await reuse(s, holder, route.decision, job.prompt, job.req, job.stream, job.deadline)
    except ReuseError as e:
        if job.stream.tokens:  # decoding had begun (chunks may be out): a second answer would garble it
            raise
        _fell_back(job, served, e, "reuse_fallback")
        return
    _took(job, served, out)
    if local:
        return
    pulled_at = out.stamps.get("grant_done", out.stamps["pull_start"])
    s.observe_pull(holder, out.bytes_pulled, out.stamps["pull_done"] - pulled_at,
                   pulled_at - out.stamps["pull_start"])


def _may_translate(s: ReceiverState, req: GenerateRequest, route: Route) -> bool:
    """Translation is tried only for an auto-mode, non-chat request with no holder of our own
    family, on a receiver that has (or refused) translators."""
    return (route.holder is None and req.mode == "auto" and req.chat is None
            and bool(s.translations or s.translator_failures))


async def _try_translate(s: ReceiverState, job: Job, served: Served) -> None:
    """Step 3: a translated pair's holder, when one caches this context."""
    try:
        translated = await holders.translate(s, job.req, job.prompt, job.stream, job.deadline)
    except ReuseError as e:
        if job.stream.tokens:
            raise
        _fell_back(job, served, e, "translate_fallback")
        return
    if translated is not None:
        served.holder, out = translated
        _took(job, served, out)
        served.path, served.plan = "translate", ReusePlan.full_reuse()


async def _own_prefill(s: ReceiverState, job: Job, served: Served) -> Generation:
    """Step 4: no cache, no config, forced, or a fault: the receiver's own full prefill."""
    check_deadline(job.deadline, "before computing")
    sampler = holders.sampler_for(s, job.req)
    keep_e = s.hold_layers()
    # one layer per job: decode steps of the requests in the batch run between them
    steps = generate_steps(s.model, job.prompt, ReusePlan.full_prefill(), max_new_tokens=job.req.max_new_tokens,
                           eos_token_id=s.eos_token_id, sampler=sampler, on_token=job.stream.on_token,
                           deadline=job.deadline, turns=True, keep_e=keep_e, logprobs=job.req.sampling.logprobs,
                           samples=holders.samples_for(s, job.req))
    stamps: dict[str, float] = {}
    busy: list[float] = []
    job.stamps["queued"] = time.perf_counter()

    def run(fn: Any, *args: Any) -> Awaitable[Any]:  # a deadline drops the prefill before it starts, not midway
        return s.run_torch(fn, *args, deadline=None if "engine_start" in stamps else job.deadline)

    try:
        gen: Generation = await drive_engine(steps, None, run, stamps, busy, decode=s.batcher.decode,
                                             turn=s.batcher.turn)
    finally:
        steps.close()
    if s.holder is not None:
        # What was computed becomes reusable before the reply goes out (the streamed tokens already
        # did): a client's next request finds it held. Costs the reply one copy of the prompt's KV.
        await pipeline.offer(s, job.prompt, gen.prefill, job.req.scope)
    served.held += sum(busy)  # its prefill's jobs: its decode steps were shared with the batch
    job.stamps["engine_start"] = stamps["engine_start"]
    job.stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
    served.gen, served.plan = gen, ReusePlan.full_prefill()
    return gen


def _took(job: Job, served: Served, out: ReuseOutcome) -> None:
    """A pulled answer: its generation, bytes, torch-thread time and stages become the request's."""
    served.gen, served.bytes_pulled, served.held = out.generation, out.bytes_pulled, out.busy_s
    job.stamps.update(out.stamps)


def _fell_back(job: Job, served: Served, e: ReuseError, event: str) -> None:
    """A way that failed before any token: the next way serves, and the reply says why."""
    served.path, served.reason = "fallback", (e.code, f"{e.code}: {e}")
    log.warning(event, request_id=job.req.request_id, reason=served.reason[1])
