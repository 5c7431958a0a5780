"""Sender handlers: one function per subject. Torch work runs in the service's worker thread."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import structlog
import torch

from droidmesh.shared.errors import BadRequestError, DeadlineExceededError, DroidMeshError
from droidmesh.shared.holding import grants
from droidmesh.shared.holding.store import on_device
from droidmesh.shared.kv.blocks import CapturedContext
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh import maps_store
from droidmesh.shared.model import text
from droidmesh.shared.model.sampling import make_sampler
from droidmesh.shared.service.engine import drive_engine
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.hashing import context_id

if TYPE_CHECKING:
    from droidmesh.services.sender.state import SenderState

log = structlog.get_logger("sender")


async def _ensure_captured(s: SenderState, ctx_ids: list[int], scope: str) -> tuple[str, CapturedContext]:
    """The context's capture in `scope`, from the store or by prefilling it now (then held and
    announced). The same tokens in another scope are another context, captured on their own."""
    cid = context_id(ctx_ids, scope)
    captured = s.store.get(cid)
    if captured is None:
        captured = dataclasses.replace(await s.run_torch(_capture, s, ctx_ids, s.e_layers()), scope=scope)
        s.metrics.prefills.inc()
        await _make_room_on_device(s, captured)
        await s.holder.put(cid, captured)
    return cid, captured


async def _make_room_on_device(s: SenderState, incoming: CapturedContext) -> None:
    """Past the device budget the least recently used device contexts move to host memory (copied
    on the torch thread, placed where the channel serves host memory from) before `incoming` is
    stored: still held and served, evicted only when the whole store is full."""
    if not on_device(incoming):
        return
    for cid, old in s.store.device_victims(incoming.nbytes):
        new = await s.run_torch(_to_host, s, old)
        if s.store.move(cid, old, new):
            s.metrics.tier_moves.inc()


def _to_host(s: SenderState, captured: CapturedContext) -> CapturedContext:
    """On the torch thread: `captured`'s tensors copied to host memory and placed there."""
    host = [t.to("cpu") for t in captured.items()]
    codes = {k: t.to("cpu") for k, t in captured.codes.items()}
    return dataclasses.replace(captured.with_items(s.holder.place(host)), codes=codes)


def _capture(s: SenderState, ctx_ids: list[int], e_layers: list[int]) -> CapturedContext:
    """On the torch thread: prefill and capture the context, place it where the bulk channel serves
    it from (`BulkServer.place`), then encode each item that loaded SCD maps for this model code,
    once (`LowRankCodec.prepare`): the codes cost about r / head_dim of the KV in the store's
    budget and take the encode off every pull (a prefix pull slices them)."""
    captured = capture_prefill(s.model, ctx_ids, e_layers)
    captured = captured.with_items(s.holder.place(captured.items()))  # where the bulk channel serves it from
    codes: dict[tuple[str, int, str], torch.Tensor] = {}
    for maps in codecs.LOWRANK.loaded():
        if maps.meta.get("sender_sha256") != s.model_sha256:
            continue
        for layer, kind in maps.codes:
            if not 0 <= layer < captured.num_layers:
                continue
            t = captured.e.get(layer) if kind == "E" else getattr(captured.kv[layer], kind.lower())
            prepared = codecs.LOWRANK.prepare(t, layer, kind, maps) if t is not None else None
            if prepared is not None:
                codes[(maps.sha256, layer, kind)] = prepared
    return dataclasses.replace(captured, codes=codes)


def _check_deadline(deadline: float) -> None:
    if deadline and time.time() > deadline:
        raise DeadlineExceededError(f"deadline passed {time.time() - deadline:.3f}s ago; dropped")


async def generate(s: SenderState, req: GenerateRequest) -> schemas.GenerateReply:
    """Answer the sender's own question over a context; the context is captured and announced.
    Sampling and stop strings apply as on a receiver; chat and streaming are a receiver's."""
    _check_deadline(req.deadline)
    if req.max_new_tokens < 1:
        raise BadRequestError("max_new_tokens must be >= 1")
    if req.chat is not None or req.stream_subject:
        raise BadRequestError("a sender answers context + question only (chat and streaming go to a receiver)")
    sp = req.sampling
    sampler = make_sampler(sp.temperature, sp.top_p, sp.seed, device=s.model.device)  # checks the ranges
    text.check_stop(sp.stop)
    t0 = time.perf_counter()
    ctx_ids, q_ids = text.prompt_ids(s.model.tokenizer, req.context, req.question)
    if not ctx_ids:
        raise BadRequestError("empty context")
    cid, captured = await _ensure_captured(s, ctx_ids, req.scope)
    captured_ms = (time.perf_counter() - t0) * 1e3
    answer = text.TextStream(s.model.tokenizer, sp.stop)
    # The sender's own KV is exact for itself: full reuse of it == full prefill, minus the work.
    steps = generate_steps(s.model, ctx_ids + q_ids, ReusePlan.full_reuse(), CapturedSource(captured),
                           max_new_tokens=req.max_new_tokens, eos_token_id=s.eos_token_id, sampler=sampler,
                           on_token=lambda t: not answer.push(t)[1])
    try:
        gen = await drive_engine(steps, None, s.run_torch, {}, decode=s.batcher.decode)
    finally:
        steps.close()
    answer.finish()
    finish: schemas.FinishReason = "stop" if answer.stopped else gen.finish_reason
    total_ms = (time.perf_counter() - t0) * 1e3
    log.info("request", request_id=req.request_id, context_id=cid, tokens=len(ctx_ids) + len(q_ids),
             new_tokens=len(gen.tokens), finish_reason=finish, capture_ms=round(captured_ms, 2),
             total_ms=round(total_ms, 2))
    return schemas.GenerateReply(
        request_id=req.request_id, text=answer.text, token_ids=gen.tokens,
        path="sender_own", fallback_reason=None, plan="own cache", sender_id=s.cfg.sender_id, bytes_pulled=0,
        ttft_ms=captured_ms + gen.ttft_s * 1e3, stages_ms={"capture": captured_ms, "total": total_ms},
        served_by=s.cfg.sender_id, prompt_tokens=len(ctx_ids) + len(q_ids),
        reused_tokens=gen.prefill.reused_tokens, finish_reason=finish,
    )


MAX_CHAT_MESSAGES = 64  # as a receiver's generate request (receiver/checks.py)


def prefill_ids(tokenizer: object, req: schemas.PrefillRequest) -> list[int]:
    """What a prefill request caches: the context's ids, or the chat opening's prefix, by the rule
    the receiver tokenizes requests with (`text.request_ids`), so they find it."""
    if req.chat is not None:
        if not 1 <= len(req.chat) <= MAX_CHAT_MESSAGES:
            raise BadRequestError(f"chat must hold 1..{MAX_CHAT_MESSAGES} messages, got {len(req.chat)}")
        if req.context:
            raise BadRequestError("a chat prefill carries its text in chat; context must be empty")
    elif not req.context:
        raise BadRequestError("empty context")
    return text.request_ids(tokenizer, req.context, chat=req.chat, prefix=True)


async def prefill(s: SenderState, req: schemas.PrefillRequest) -> schemas.PrefillReply:
    """A prefill-only job: capture and announce a context so receivers can reuse it."""
    ctx_ids = prefill_ids(s.model.tokenizer, req)
    if not ctx_ids:
        raise BadRequestError("empty context")
    cid, captured = await _ensure_captured(s, ctx_ids, req.scope)
    log.info("request", request_id=req.request_id, context_id=cid, tokens=len(ctx_ids), nbytes=captured.nbytes,
             scope=req.scope)
    return schemas.PrefillReply(request_id=req.request_id, context_id=cid, tokens=len(ctx_ids), nbytes=captured.nbytes)


async def on_config(s: SenderState, cfg: schemas.RecomputeConfig) -> None:
    """A profile naming this sender's model: its receiver model becomes a reader and, for these
    exact weights, E is kept for every group start and patch layer it may use (`Holder.on_config`);
    the SCD maps its coded plans name are loaded (a failure only costs those plans: the receiver's
    pull under them is refused and it falls back). A withdrawn config: `on_withdrawn`."""
    if not s.holder.on_config(cfg):
        return
    points = (*cfg.frontier, cfg.chosen)
    for sha in sorted(maps_store.referenced(points)):
        try:
            await maps_store.load(s.bus.maps_store(), sha, s.model_sha256, "sender")
        except DroidMeshError as e:
            log.warning("maps_unavailable", receiver_model=cfg.receiver_model, maps=sha[:12], error=f"{e.code}: {e}")
    log.info("config_loaded", receiver_model=cfg.receiver_model, version=cfg.profile_version,
             e_layers=sorted(s.held.profiled_e.get(cfg.receiver_model, ())))


async def on_withdrawn(s: SenderState, cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
    """A config was withdrawn from the board (`left`: those still on it): a receiver model no
    config pairs with this sender's model any more is refused its next grant, and E is kept only
    for the plans of the configs left (`grants.unpair_withdrawn`)."""
    grants.unpair_withdrawn(s.holder, left)
    if cfg.sender_model != s.cfg.model_id:
        return
    log.info("config_withdrawn", receiver_model=cfg.receiver_model, version=cfg.profile_version,
             e_layers=sorted(s.held.profiled_e.get(cfg.receiver_model, ())))
