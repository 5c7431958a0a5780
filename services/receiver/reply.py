"""After a request is served: its timings, metrics, the audit's feedback, the request log line
and the `GenerateReply`.

Called by `answer.answer` on the event loop, once per served request, after the answer stream
closed; nothing here blocks (a shadow, when the audit picks one, is a supervised background task).
Trusts what `answer.py` hands it: a served request has a generation and a "first_token" stamp.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import structlog

from droidmesh.services.receiver import relay_watch
from droidmesh.shared.kv.decode import Logprob
from droidmesh.shared.kv.partial import Generation
from droidmesh.shared.model.text import TextStream, token_text
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.logprobs import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from droidmesh.services.receiver.answer import Job, Route, Served
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the reply and the log line share."""

    finish: schemas.FinishReason
    ttft_ms: float
    stages_ms: dict[str, float]  # per stage, ms since the request's start, in time order; "done" last
    why: str | None  # the fallback or full-prefill reason shown to the client
    label: str  # the plan served, as the client reads it
    predicted_ms: dict[str, float]  # the policy's prediction per option


def finish(s: ReceiverState, job: Job, route: Route, served: Served, gen: Generation, text: str
           ) -> schemas.GenerateReply:
    """Record `served`'s outcome (metrics, audit, log) and build its reply with the answer's `text`."""
    t0 = job.stamps["start"]
    end: schemas.FinishReason = "stop" if job.stream.text.stopped else gen.finish_reason
    stages_ms = _stages_ms(job.stamps, t0)
    ttft_ms = (job.stamps["first_token"] - t0) * 1e3
    shown = served.reason if served.path in ("fallback", "full_prefill") else None
    _record(s, served.path, shown[0] if shown is not None else "", ttft_ms, stages_ms, served.bytes_pulled,
            job.stamps)
    predicted_ms = {k: round(v * 1e3, 3) for k, v in route.decision.predicted_s.items()}
    shadowed = _feed_audit(s, job, route, served, gen, ttft_ms)
    holder = served.holder
    label = (f"translated from {holder.model_id}" if served.path == "translate" and holder is not None
             else served.plan.label())
    summary = Summary(end, ttft_ms, stages_ms, shown[1] if shown is not None else None, label, predicted_ms)
    _log_request(s, job, route, served, gen, summary, shadowed)
    return _reply(s, job, route, served, gen, text, summary)


def _stages_ms(stamps: dict[str, float], t0: float) -> dict[str, float]:
    done = time.perf_counter()
    stages_ms = {k: round((v - t0) * 1e3, 3) for k, v in sorted(stamps.items(), key=lambda kv: kv[1])}
    stages_ms["done"] = round((done - t0) * 1e3, 3)
    return stages_ms


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


def _feed_audit(s: ReceiverState, job: Job, route: Route, served: Served, gen: Generation, ttft_ms: float) -> bool:
    """The compute thread's recent hold time, the calibration (the served option's TTFT less its
    wait behind other requests for the compute thread), the relay dashboard, and maybe a shadow
    (`relay_watch.shadow`); whether a shadow was queued."""
    req, holder, path = job.req, served.holder, served.path
    waited = max(0.0, job.stamps.get("engine_start", route.decided) - route.decided)
    s.queue_wait.observe(served.held)
    relay_watch.calibrate(s, route.decision, path, holder, ttft_ms / 1e3 - waited)
    relay_watch.count_relay(s, route.decision, route.assignment, path, route.online, ttft_ms / 1e3)
    shadowed = (route.assignment in ("treatment", "blind") and path in ("partial", "full_reuse") and not job.stream.gone
                and s.cfg.shadow_share > 0 and req.sampling.temperature == 0 and s.rng.random() < s.cfg.shadow_share)
    if shadowed:
        s.background(relay_watch.shadow(s, req.request_id, holder.model_id if holder else "", req.context,
                                        req.question, job.prompt, gen.tokens), f"shadow-{req.request_id}")
    return shadowed


def _log_request(s: ReceiverState, job: Job, route: Route, served: Served, gen: Generation, summary: Summary,
                 shadowed: bool) -> None:
    holder, prompt, decision, online = served.holder, job.prompt, route.decision, route.online
    log.info("request", request_id=job.req.request_id, path=served.path, plan=summary.label, reason=summary.why,
             assignment=route.assignment, holdout_share=s.cfg.holdout_share, blind_share=s.cfg.blind_share,
             shadowed=shadowed, predicted_ttft_ms=_ms(decision.predicted_ttft_s),
             decision_ms=round(route.decision_ms, 4),
             options_ms=summary.predicted_ms, reused_fraction=round(gen.prefill.reused_tokens / max(1, len(prompt)), 4),
             reusable_fraction=round((online.reused_tokens or 0) / max(1, len(prompt)), 4),
             sender_model=holder.model_id if holder else None, receiver_model=s.cfg.model_id,
             context_tokens=len(holder.token_ids) if holder else 0, queued=online.queued,
             topology=_topology(holder) if holder else None,
             prompt_tokens=len(prompt), reused_tokens=gen.prefill.reused_tokens, bytes_pulled=served.bytes_pulled,
             new_tokens=len(gen.tokens), max_new_tokens=job.req.max_new_tokens, cancelled=job.stream.gone,
             decode_batch=gen.decode_batch,
             finish_reason=summary.finish, chunks=job.stream.published,
             chunk_failures=job.stream.failed, ttft_ms=round(summary.ttft_ms, 3), stages_ms=summary.stages_ms,
             scope=job.req.scope)


def _reply(s: ReceiverState, job: Job, route: Route, served: Served, gen: Generation, text: str,
           summary: Summary) -> schemas.GenerateReply:
    holder, decision = served.holder, route.decision
    return schemas.GenerateReply(
        request_id=job.req.request_id, text=text, token_ids=gen.tokens, path=served.path,
        fallback_reason=summary.why, plan=summary.label,
        sender_id=holder.sender_id if holder is not None and served.path != "full_prefill" else None,
        bytes_pulled=served.bytes_pulled, ttft_ms=summary.ttft_ms, stages_ms=summary.stages_ms,
        served_by=s.cfg.receiver_id, prompt_tokens=len(job.prompt), reused_tokens=gen.prefill.reused_tokens,
        finish_reason=summary.finish, codec=decision.codec if served.plan.mode != "full_prefill" else "",
        predicted_ttft_ms=_ms(decision.predicted_ttft_s) or 0.0, options_ms=summary.predicted_ms,
        logprobs=_logprobs(s, gen.logprobs),
        samples=[schemas.SampleReply(text=t, token_ids=x.tokens, finish_reason="stop" if stopped else x.finish_reason,
                                     logprobs=_logprobs(s, x.logprobs))
                 for x in gen.samples for t, stopped in [sample_text(s, job.req, x.tokens)]],
    )


def sample_text(s: ReceiverState, req: GenerateRequest, tokens: list[int]) -> tuple[str, bool]:
    """A further sample's text as its stop strings cut it (what its decoding stopped on), and
    whether one did."""
    if s.model.tokenizer is None:
        return "", False
    stream = TextStream(s.model.tokenizer, req.sampling.stop)
    for t in tokens:
        if stream.push(t)[1]:
            break
    stream.finish()
    return stream.text, stream.stopped


def _logprobs(s: ReceiverState, logprobs: list[Logprob] | None) -> list[TokenLogprob] | None:
    """Log-probabilities with each token's text (the receiver's tokenizer)."""
    if logprobs is None:
        return None
    tok = s.model.tokenizer

    def piece(token_id: int) -> str:
        return token_text(tok, token_id) if tok is not None else ""

    return [TokenLogprob(token_id=t, token=piece(t), logprob=lp,
                         top=[TopLogprob(token_id=i, token=piece(i), logprob=v) for i, v in top])
            for t, lp, top in logprobs]


def _topology(holder: schemas.CacheAvailable) -> str:
    """"same_host" when the holder's bulk channel is a same-host one (shm, inproc) or its address a
    loopback one, else "remote" (the audit's stratum)."""
    if holder.transport in ("shm", "inproc"):
        return "same_host"
    host = holder.address.rsplit(":", 1)[0].strip("[]")
    return "same_host" if host in ("127.0.0.1", "localhost", "::1") else "remote"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
