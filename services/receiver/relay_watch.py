"""The receiver's side of the relay audit: whether relaying helps and does no harm, measured in
the receiver. Who is held out (a random share of the requests the policy would relay is served by
the receiver's own prefill instead, a control group to measure relaying's benefit against), what
the dashboard and the policy's calibration learn from each request, and the quality watch
(shadows, drift, re-profiling).

Per request (`answer.py` and `reply.py` call them, on the loop, none blocks): `assign` randomizes the holdout,
`calibrate` feeds the measured TTFT back to the policy's calibration, `count_relay` counts the
outcome, the benefit and the prediction error for the dashboard.
The quality watch, per relayed request the audit picks for a shadow (`shadow`, a supervised background task):
  1. wait for the other shadows (one runs at a time) and until the receiver is idle (never ahead
     of a request); dropped SHADOW_WAIT_S after it was queued;
  2. answer the same prompt by the receiver's own full prefill and log the token agreement of the
     two greedy answers ("shadow"); it runs a layer or a decode step at a time, each only while
     no request is in the receiver, so a request arriving mid-shadow waits one layer, not a prefill;
  3. `QualityWatch.observe` keeps it per sender model (a sliding window, the gauge
     `dm_shadow_agreement`) with the row (context, question, the full prefill's answer);
  4. when the window's mean falls below `quality_threshold`, the watch fires once ("quality_drift",
     `dm_quality_drift`) and `reprofile` asks the profiler service to profile the pair again on
     the kept rows, bound to the weights of the config in use. Under NATS users the profiler
     publishes re-profiles for operators only: it refuses this receiver's (logged here as
     `reprofile_failed`, and at the profiler as `reprofile_wanted` for the operator, who profiles
     and publishes); on a server without users it publishes it. A new config reaches this receiver
     through the config board like any other (no restart);
  5. until then the pair is held (`hold`): requests that would relay from that sender model get the
     receiver's own prefill (reason quality_hold), so a drop costs only the requests before the alarm;
  6. a newer config for that sender model lifts the hold and re-arms the watch with an empty window (`reset`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import structlog

from droidmesh.shared.audit.relay import reusable_bucket
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.partial import Generation, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import Need, run_until
from droidmesh.shared.wire import schemas, subjects

if TYPE_CHECKING:
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")

SHADOW_WAIT_S = 60.0  # a shadow not done this long after it was queued is dropped (it only runs when idle)
SHADOW_POLL_S = 0.005  # how often a paused shadow looks for an idle receiver


class QualityWatch:
    """Shadow agreements per sender model over the last `window` shadows, with the rows they came
    from (the last `keep_rows`). The receiver calls `observe` after each shadow, `reset` when a
    newer config for the model loads, `rows` to re-profile; none blocks. `observe` returns True
    once per drop: when at least `min_samples` are in and their mean is below `threshold`
    (0: never); it stays quiet until `reset`. Models tracked are bounded (least recent go)."""

    def __init__(self, window: int, min_samples: int, threshold: float, keep_rows: int = 32, max_models: int = 256):
        self._window, self._min, self._threshold = window, min(min_samples, window), threshold
        self._keep, self._max_models = keep_rows, max_models
        self._seen: OrderedDict[str, tuple[deque[float], deque[schemas.ProfileRow]]] = OrderedDict()
        self._fired: set[str] = set()

    def observe(self, model: str, agreement: float, row: schemas.ProfileRow | None) -> bool:
        agreements, rows = (self._seen.pop(model) if model in self._seen
                            else (deque(maxlen=self._window), deque(maxlen=self._keep)))
        self._seen[model] = (agreements, rows)
        while len(self._seen) > self._max_models:
            self._fired.discard(self._seen.popitem(last=False)[0])
        agreements.append(min(1.0, max(0.0, agreement)))
        if row is not None:
            rows.append(row)
        mean = self.agreement(model)
        if model in self._fired or mean is None or len(agreements) < self._min or mean >= self._threshold:
            return False
        self._fired.add(model)
        return True

    def agreement(self, model: str) -> float | None:
        """The window's mean agreement (None before any shadow)."""
        seen = self._seen.get(model)
        return sum(seen[0]) / len(seen[0]) if seen and seen[0] else None

    def rows(self, model: str) -> list[schemas.ProfileRow]:
        seen = self._seen.get(model)
        return list(seen[1]) if seen else []

    def held(self, model: str) -> bool:
        """Whether `model`'s quality dropped and no newer config has come since (relaying from it is held)."""
        return model in self._fired

    def reset(self, model: str) -> None:
        """A new config serves `model`'s contexts: judge it on its own shadows, armed again."""
        seen = self._seen.get(model)
        if seen is not None:
            seen[0].clear()
        self._fired.discard(model)


def assign(s: ReceiverState, decision: policy.Decision, mode: str) -> tuple[policy.Decision, str]:
    """The randomized audit's assignment. A request where relaying was possible and weighed (its
    decision either way) is, with probability `holdout_share`, served by full prefill ("control");
    with probability `blind_share`, relayed whatever the policy chose ("blind": what relaying
    itself does, also where the policy would not relay); else as the policy chose ("treatment").
    Forced modes and requests with nothing to relay are "ineligible". Logged with the shares."""
    if mode != "auto" or not decision.weighed:
        return decision, "ineligible"
    draw = s.rng.random()
    if draw < s.cfg.holdout_share:
        held = policy.Decision(ReusePlan.full_prefill(), "full_prefill",
                               ("holdout", f"randomized control (holdout share {s.cfg.holdout_share:g})"),
                               predicted_s=decision.predicted_s, raw_s=decision.raw_s, weighed=True,
                               predicted_ttft_s=decision.predicted_s.get(policy.PREFILL_OPTION))
        return held, "control"
    if draw < s.cfg.holdout_share + s.cfg.blind_share:
        return decision.relay_option or decision, "blind"
    return decision, "treatment"


def hold(s: ReceiverState, holder: schemas.CacheAvailable | None, decision: policy.Decision) -> policy.Decision:
    """While the watch holds a sender model (its quality dropped, the re-profiled config has not come),
    requests that would relay from it get the receiver's own prefill instead, outside the experiment."""
    if holder is None or not decision.weighed or not s.watch.held(holder.model_id):
        return decision
    why = (f"quality_hold: shadow agreement with {holder.model_id}'s cache fell below {s.cfg.quality_threshold:g}; "
           f"own prefill until a newer config for the pair arrives")
    return policy.Decision(ReusePlan.full_prefill(), "full_prefill", ("quality_hold", why),
                           predicted_s=decision.predicted_s, raw_s=decision.raw_s,
                           predicted_ttft_s=decision.predicted_s.get(policy.PREFILL_OPTION))


def calibrate(s: ReceiverState, decision: policy.Decision, path: str, holder: schemas.CacheAvailable | None,
              ttft_s: float) -> None:
    """Feed the served option's measured TTFT (less its wait for the compute thread: `ttft_s` is
    what the option itself took) to the calibration, against its uncalibrated prediction."""
    if path == "full_prefill" and policy.PREFILL_OPTION in decision.raw_s:
        s.calibration.observe(policy.PREFILL_KIND, decision.raw_s[policy.PREFILL_OPTION], ttft_s)
    elif path in ("partial", "full_reuse") and holder is not None and decision.raw_ttft_s:
        s.calibration.observe(policy.reuse_kind(holder.model_id), decision.raw_ttft_s, ttft_s)


def count_relay(s: ReceiverState, decision: policy.Decision, assignment: str, path: str, online: policy.Online,
                 ttft_s: float) -> None:
    """The relay dashboard's counters: outcome per reusable-prefix bucket, the benefit, the prediction error."""
    if assignment == "ineligible":
        return
    bucket = reusable_bucket((online.reused_tokens or 0) / max(1, online.tokens))
    relayed = path in ("partial", "full_reuse")
    outcome = assignment if assignment in ("control", "blind") else "relayed" if relayed else "own_prefill"
    s.metrics.relay.labels(bucket, outcome).inc()
    own = decision.predicted_s.get(policy.PREFILL_OPTION)
    if relayed and own is not None:
        (s.metrics.saved if own >= ttft_s else s.metrics.lost).inc(abs(own - ttft_s))
    if decision.predicted_ttft_s is not None and ttft_s > 0:
        s.metrics.prediction_error.observe(abs(decision.predicted_ttft_s - ttft_s) / ttft_s)


def _pause_at_turns(need: Need) -> bool:
    """A shadow stops at every turn (a layer, a decode step) and decodes alone: it never joins
    the requests' batch."""
    return need.kind == "decode"


async def _shadow_answer(s: ReceiverState, prompt: list[int], n: int, waited: float) -> Generation | None:
    """The receiver's own greedy answer of `n` tokens, a layer or a decode step at a time, each
    only while no request is in the receiver; None once `waited` (time.monotonic()) has passed."""
    steps = generate_steps(s.model, prompt, ReusePlan.full_prefill(), max_new_tokens=n, eos_token_id=s.eos_token_id,
                           turns=True)
    while True:
        while s.inflight > 0:
            if time.monotonic() >= waited:
                steps.close()
                return None
            await asyncio.sleep(SHADOW_POLL_S)
        finished, ref = await s.run_torch(run_until, steps, _pause_at_turns)  # one layer or decode step
        if finished:
            return ref


async def shadow(s: ReceiverState, request_id: str, sender_model: str, context: str, question: str,
                 prompt: list[int], served: list[int]) -> None:
    """Steps 1-4 of the module docstring for one relayed request."""
    waited = time.monotonic() + SHADOW_WAIT_S
    try:  # one shadow at a time: a waiting one holds no cache, and an idle moment resumes one shadow, not all
        await asyncio.wait_for(s.shadow_lock.acquire(), SHADOW_WAIT_S)
    except TimeoutError:
        log.info("shadow_skipped", request_id=request_id, reason="other shadows ahead")
        return
    try:
        ref = await _shadow_answer(s, prompt, len(served), waited)
    finally:
        s.shadow_lock.release()
    if ref is None:
        log.info("shadow_skipped", request_id=request_id, reason="receiver busy")
        return
    same = sum(a == b for a, b in zip(served, ref.tokens, strict=False))
    agreement = same / max(len(served), len(ref.tokens))
    s.shadow_agreements.append(agreement)
    answer = s.model.tokenizer.decode(ref.tokens, skip_special_tokens=True) if s.model.tokenizer is not None else ""
    row = schemas.ProfileRow(context=context, input=question, answers=[answer]) if context else None  # chat: no row
    fired = s.watch.observe(sender_model, agreement, row)
    window = s.watch.agreement(sender_model)
    s.metrics.agreement.labels(sender_model).set(window if window is not None else agreement)
    log.info("shadow", request_id=request_id, agreement=round(agreement, 4), tokens=len(served),
             sender_model=sender_model, window_agreement=round(window, 4) if window is not None else None)
    if fired:
        s.metrics.drift.labels(sender_model).inc()
        log.warning("quality_drift", sender_model=sender_model, window_agreement=round(window or 0.0, 4),
                    threshold=s.cfg.quality_threshold, rows=len(s.watch.rows(sender_model)))
        if s.cfg.reprofile:
            s.background(reprofile(s, sender_model), f"reprofile-{sender_model}")


async def reprofile(s: ReceiverState, sender_model: str) -> None:
    """Step 4's request: the pair's config in use names the task, tolerance and weights; the rows
    are the watch's. The new config arrives through the board; the reply is only logged."""
    cfg = s.configs.get(sender_model)
    rows = s.watch.rows(sender_model)
    if cfg is None or len(rows) < 2:
        log.warning("reprofile_skipped", sender_model=sender_model,
                    reason="no config in use (a default group)" if cfg is None else f"{len(rows)} row(s) kept")
        return
    req = schemas.ProfileRequest(
        request_id=f"reprofile-{uuid.uuid4().hex[:12]}", sender_path=sender_model, receiver_path=s.cfg.model_id,
        task=cfg.task, sender_model=sender_model, receiver_model=s.cfg.model_id, n_train=len(rows), n_test=len(rows),
        tolerance=cfg.tolerance, exhaustive=False, other_tasks=[], rows=rows, sender_sha256=cfg.sender_sha256,
        receiver_sha256=cfg.receiver_sha256)
    log.info("reprofile_requested", request_id=req.request_id, sender_model=sender_model, rows=len(rows),
             version=cfg.profile_version)
    try:
        # the receiver-only subject of this model: the profiler keeps the pair's relay buckets and
        # chooses the version itself, so a receiver can only ask for its own pair, with rows
        data = await s.bus.request(subjects.profiler_reprofile(s.cfg.model_id), schemas.encode(req),
                                   timeout=s.cfg.reprofile_timeout_s)
        try:
            reply = schemas.decode(data, schemas.ProfileReply)
        except DroidMeshError:
            err = schemas.decode(data, schemas.ErrorReply)
            raise DroidMeshError(f"{err.code}: {err.message}") from None
    except (DroidMeshError, TimeoutError) as e:
        log.warning("reprofile_failed", request_id=req.request_id, sender_model=sender_model, error=str(e))
        return
    log.info("reprofile_done", request_id=req.request_id, sender_model=sender_model,
             version=reply.config.profile_version, chosen=reply.config.chosen.plan.groups)
