"""The receiver's reuse pipeline: pull a holder's tensors while the engine already computes.

`reuse_generate` starts one pull (`shared/transport/pull.py`: transition-layer E first, then the
reused KV layers in layer order) and, concurrently, drives the engine's steps: each step runs on
the torch worker thread, and where the engine needs a layer that has not landed yet the driver
waits for it on the event loop, not on the torch thread. So recompute begins the moment E lands,
and while this request waits for a slow sender other requests' compute uses the thread. A pull
failure is reported into the source, which makes the engine's next read raise
`MissingLayerError`; an engine failure cancels the pull. Either way the caller gets a
`ReuseError` and falls back. Everything here is bounded by `timeout_s`, waiting for a pull slot
included (stalled pulls hold slots only until their own timeout, and full-prefill requests take
none), and by the request's `deadline`: a step still queued for the torch thread when it passes is
dropped (`DeadlineExceededError`), and decoding stops there.

Every tensor the engine reads from a pull is screened (`shared/kv/screen.py`, unless the
`kv_screen` knob is off) against this receiver's own statistics, built once on first use (or at
start: `screen_for`): finite garbage (zeros, sign-flipped, noise at the right scale) fails it
with an `IntegrityError`, so the request falls back like any other integrity failure.

`local_generate` runs a plan over a context this receiver holds itself (what `offer` kept of an
earlier full prefill, under any model this process serves): read in place, nothing pulled.

`translate_generate` is the same pull-while-computing for a translated pair: it pulls the source
model's E at the layers the translator reads (into buffers shaped by the source's fingerprint,
`ForeignLayout`), and the engine reads a `TranslatedSource` over them, so each target layer is
translated as its source layer lands. The receiver's translators are loaded at start
(`load_translators`), each hash-checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from droidmesh.shared.errors import CacheLayoutError, DroidMeshError, MissingLayerError, ReuseError, TransferError
from droidmesh.shared.kv import translate
from droidmesh.shared.kv.blocks import CapturedContext
from droidmesh.shared.kv.capture import captured_of
from droidmesh.shared.kv.partial import Generation, PrefillResult, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.policy import Decision
from droidmesh.shared.kv.screen import Screen, ScreenedSource
from droidmesh.shared.kv.sources import ArrivingSource, CapturedSource, LayerSource, Steps
from droidmesh.shared.kv.translate import TranslatedSource, Translator, TranslatorMismatchError, align
from droidmesh.shared.mesh.maps_store import MapsStore
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.model.fingerprint import require_compatible
from droidmesh.shared.model.sampling import Sampler
from droidmesh.shared.service.engine import Watched, drive_engine
from droidmesh.shared.transport.pull import ForeignLayout, Layout, pull_into, pull_items, request_grant, source_for, window_starts
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.hashing import common_prefix, held_context_id
from droidmesh.shared.wire.schemas import PullItem

if TYPE_CHECKING:
    from droidmesh.services.receiver.state import ReceiverState

log = structlog.get_logger("receiver")


@dataclasses.dataclass(frozen=True)
class Translation:
    """A translator this receiver loaded (hash checked) and its source model's tokenizer."""

    translator: Translator
    source_tokenizer: Any


async def load_translators(entries: tuple[str, ...], store: MapsStore, model: ModelAdapter, model_sha256: str,
                           timeout_s: float) -> tuple[dict[str, Translation], list[str]]:
    """The translators `entries` name ('FILE@SHA256' read here, or a bare 'SHA256' fetched from
    the maps bucket within `timeout_s`, where `droidmesh profile --translate --publish` put it), by
    source model, on `model`'s device, and one line per entry that could not be loaded (missing,
    another hash, not a translator, for another receiver model, no source tokenizer). Never raises:
    a refused translator costs only the requests that would use it."""
    loaded: dict[str, Translation] = {}
    failures: list[str] = []
    for entry in entries:
        path, _, sha = entry.rpartition("@")
        name = Path(path).name if path else f"{sha[:12]}... (maps bucket)"
        try:
            if path:
                tr = translate.load(path, sha)
            else:
                async with asyncio.timeout(timeout_s):
                    tr = translate.from_bytes(await store.get(sha), sha, name)
            tr.check_models(tr.source_fp, model.fingerprint)
            if tr.target_sha256 and tr.target_sha256 != model_sha256:
                raise TranslatorMismatchError(f"translator {name} was fit for other {model.name} weights")
            if not tr.source_tokenizer or not getattr(model.tokenizer, "is_fast", False):
                raise TranslatorMismatchError(f"translator {name}: aligning needs the source's tokenizer in the file and "
                                              "a fast tokenizer here")
            loaded[tr.source_model] = Translation(tr.to(model.device), text.tokenizer_from_spec(tr.source_tokenizer))
        except DroidMeshError as e:
            failures.append(f"{e.code}: {name}: {e}")
        except Exception as e:  # the bucket's own errors (NATS, JetStream, a timeout): this entry only
            failures.append(f"translator_unavailable: {name}: {type(e).__name__}: {e}")
    return loaded, failures


def align_target(target_tokenizer: Any, context: str, s_ids: list[int], s_spans: list[Any]) -> Tokenized:
    """`context` in the receiver's tokens, aligned to the source's (`s_ids`, `s_spans`: the
    source's tokenizer's, once they found a holder). Blocking: it tokenizes."""
    t_ids, t_spans = text.context_spans(target_tokenizer, context)
    return Tokenized(s_ids, t_ids, align(s_spans, t_spans))


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """A context in a translated pair's two tokenizations: the source's ids (what its holder
    cached), the receiver's, and each receiver token's source span (`translate.align`)."""

    source_ids: list[int]
    target_ids: list[int]
    spans: list[tuple[int, int]]


@dataclasses.dataclass
class ReuseOutcome:
    generation: Generation
    bytes_pulled: int
    stamps: dict[str, float]  # absolute time.perf_counter() per stage
    busy_s: float  # how long the engine held the torch thread (its waits for layers left it free)


async def reuse_generate(
    s: ReceiverState, holder: schemas.CacheAvailable, decision: Decision, prompt: list[int], max_new_tokens: int,
    timeout_s: float, *, sampler: Sampler | None = None, on_token: Callable[[int], bool] | None = None, logprobs: int | None = None,
    samples: Sequence[tuple[Sampler, Callable[[int], bool] | None]] = (),
    deadline: float | None = None,
) -> ReuseOutcome:
    """`sampler` and `on_token` go to the engine's decoding as they are (see `generate_steps`);
    `deadline` (time.monotonic()) is the request's."""
    model, plan = s.model, decision.plan
    source = source_for(holder, prompt)  # only the prefix this prompt reuses is pulled
    require_compatible(source.fingerprint, model.fingerprint)
    starts = window_starts(plan, model.windows, len(source.token_ids), decision.codec)  # sliding layers: their window
    items = pull_items(plan, model.num_layers, starts)
    screen = await screen_for(s)
    read: LayerSource = source if screen is None else ScreenedSource(
        source, screen, model, [(i.kind, i.layer) for i in items], plan.patch, starts)
    steps = generate_steps(model, prompt, plan, read, max_new_tokens=max_new_tokens, eos_token_id=s.eos_token_id,
                           timeout_s=timeout_s, sampler=sampler, on_token=on_token, deadline=deadline,
                           logprobs=logprobs, samples=samples)
    return await _pull_and_run(s, holder, items, model, source, source, steps, timeout_s, deadline, decision.codec,
                               decision.codec_params)


async def local_generate(
    s: ReceiverState, holder: schemas.CacheAvailable, decision: Decision, prompt: list[int], max_new_tokens: int,
    scope: str, *, sampler: Sampler | None = None, on_token: Callable[[int], bool] | None = None, logprobs: int | None = None,
    samples: Sequence[tuple[Sampler, Callable[[int], bool] | None]] = (),
    deadline: float | None = None,
) -> ReuseOutcome:
    """The plan over a context this receiver holds itself (`holder` is its own announcement):
    the engine reads the stored tensors in place, so nothing is pulled, encoded or screened (they
    are this process's own computation); a context evicted meanwhile is a `ReuseError` (fallback).
    The store's hold keeps its bytes counted until the engine is done with them."""
    assert s.holder is not None  # `ReceiverState.holds(holder)` was checked
    pin = s.holder.store.hold(holder.context_id)
    captured = s.holder.store.get(holder.context_id)
    if captured is None:
        pin.release()
        raise TransferError(f"held context {holder.context_id[:16]} was evicted before it was read")
    stamps: dict[str, float] = {}
    # Its own weights' KV, fully reused, plus the suffix it computes is its own KV of the whole
    # prompt: held too (a conversation's next turn, a document after a shared preamble).
    own = decision.plan == ReusePlan.full_reuse() and holder.model_sha256 == s.policy_facts.model_sha256
    keep_e = s.hold_layers() if own else []

    steps = generate_steps(s.model, prompt, decision.plan, CapturedSource(captured), max_new_tokens=max_new_tokens,
                           eos_token_id=s.eos_token_id, sampler=sampler, on_token=on_token, deadline=deadline,
                           keep_e=keep_e, logprobs=logprobs, samples=samples)
    busy: list[float] = []
    try:
        gen = await drive_engine(steps, None, functools.partial(s.run_torch, deadline=deadline), stamps, busy,
                                 decode=s.batcher.decode)
    finally:
        steps.close()
        pin.release()
    for stage, rel in gen.prefill.stages.items():  # on the clock of the arrivals: the prefill's own start
        stamps[stage] = gen.prefill.started_at + rel
    stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
    if own and gen.prefill.reused_tokens < len(prompt) - 1:  # else nothing new was computed
        await offer(s, prompt, gen.prefill, scope, prefix=captured)  # the request's scope: its suffix is its own
    return ReuseOutcome(gen, 0, stamps, sum(busy))


async def offer(s: ReceiverState, prompt: list[int], pre: PrefillResult, scope: str,
                prefix: CapturedContext | None = None) -> None:
    """Hold what a full prefill of `prompt` computed (its KV and kept E), or a full reuse of
    `prefix` (this model's own held context) and the suffix after it, in `scope`, announced like
    a sender's capture. Runs once decoding is done, before the reply (the copy out of the serving
    cache takes the torch thread between requests); a context already held, or one the store
    cannot take, is skipped: holding never fails a request."""
    holder = s.holder
    if holder is None or len(prompt) < 2:  # one token leaves nothing to reuse (one is always computed)
        return
    cid = held_context_id(prompt, scope, s.policy_facts.model_sha256)
    if holder.store.get(cid) is not None:
        return
    t0 = time.perf_counter()

    def capture() -> CapturedContext:
        captured = captured_of(s.model, prompt, pre, prefix)
        placed = captured.with_items(holder.place(captured.items()))
        return dataclasses.replace(placed, scope=scope, model_name=s.cfg.model_id)  # announced under its served id

    try:
        captured = await s.run_torch(capture)
        await holder.put(cid, captured)
    except DroidMeshError as e:  # over the budget, or pinned by pulls: this context is not held
        log.info("hold_skipped", context_id=cid, tokens=len(prompt), reason=f"{e.code}: {e}")
        return
    log.info("held", context_id=cid, tokens=len(prompt), nbytes=captured.nbytes, e_layers=sorted(captured.e),
             ms=round((time.perf_counter() - t0) * 1e3, 2))


async def screen_for(s: ReceiverState) -> Screen | None:
    """This receiver's KV screen (None: the `kv_screen` knob is off, or the model has no tokenizer
    to build the reference with; pulled tensors then get only the range checks). Built once, on
    the torch thread; a build that failed is tried again by the next request."""
    if not s.cfg.kv_screen:
        return None
    task = s.screen_build
    if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
        task = s.screen_build = asyncio.get_running_loop().create_task(_build_screen(s))
    return await asyncio.shield(task)  # a request that gives up leaves the build running for the next


async def _build_screen(s: ReceiverState) -> Screen | None:
    t0 = time.perf_counter()
    screen: Screen | None = await s.run_torch(Screen.of_model, s.model)
    if screen is None:
        log.warning("kv_screen_unavailable", reason=f"{s.model.name} has no tokenizer to build the reference with")
    else:
        log.info("kv_screen_ready", ms=round((time.perf_counter() - t0) * 1e3, 1), no_direction_test=screen.coverage(),
                 structure_test_from_tokens=screen.structure_tokens())
    return screen


async def translate_generate(
    s: ReceiverState, holder: schemas.CacheAvailable, translator: Translator, tokenized: Tokenized, prompt: list[int],
    max_new_tokens: int, timeout_s: float, *, sampler: Sampler | None = None,
    on_token: Callable[[int], bool] | None = None, logprobs: int | None = None,
    samples: Sequence[tuple[Sampler, Callable[[int], bool] | None]] = (), deadline: float | None = None,
) -> ReuseOutcome:
    """The translated path (`shared/kv/translate.py`): pull the source E the translator reads from
    a holder of the source model's cache of the whole context, translate each target layer as its
    source layer lands, and run the receiver's engine on it (full reuse of the translated KV).
    `tokenized`: the context in the source's and the receiver's tokens, and their alignment;
    `check_translatable` has passed."""
    model, source_fp = s.model, translator.source_fp
    arriving = ArrivingSource(tuple(tokenized.source_ids), source_fp)
    translated = TranslatedSource(arriving, translator, model, tokenized.target_ids, tokenized.spans, source_fp)
    steps = generate_steps(model, prompt, ReusePlan.full_reuse(), translated, max_new_tokens=max_new_tokens,
                           eos_token_id=s.eos_token_id, timeout_s=timeout_s, sampler=sampler, on_token=on_token,
                           deadline=deadline, logprobs=logprobs, samples=samples)
    items = [PullItem(layer=l, kind="E") for l in translator.source_layers]
    layout = ForeignLayout(source_fp, model.dtype, model.device)
    return await _pull_and_run(s, holder, items, layout, arriving, translated, steps, timeout_s, deadline, "raw", {})


def check_translatable(holder: schemas.CacheAvailable, translator: Translator, source_ids: list[int],
                       model: ModelAdapter, transport: str) -> None:
    """Raise (a `ReuseError`, before any pull: no fault of the holder's sender) unless `holder` is
    the translator's source model (its weights, when the translator is bound to them) caching the
    whole context in the source's tokens, with E of every layer the translator reads, in our dtype
    over our bulk channel."""
    if holder.model_id != translator.source_model or holder.fingerprint_id != translator.source_fp.id:
        raise TranslatorMismatchError(f"holder's model {holder.model_id} is not the translator's source {translator.source_model}")
    if translator.source_sha256 and holder.model_sha256 != translator.source_sha256:
        raise TranslatorMismatchError(f"holder's {holder.model_id} weights are not those the translator was fit on")
    if common_prefix(holder.token_ids, source_ids) != len(source_ids):
        raise ReuseError("the holder's cache does not cover the whole context in the source's tokens")
    missing = sorted(set(translator.source_layers) - set(holder.e_layers))
    if missing:
        raise MissingLayerError(f"the holder keeps E of layers {holder.e_layers}; the translator reads {missing} too "
                                f"(start its sender with --e-layers covering {translator.source_layers})")
    if holder.dtype != dtype_name(model.dtype) or holder.transport != transport:
        raise CacheLayoutError(f"holder serves {holder.dtype} over {holder.transport}; this receiver runs "
                               f"{dtype_name(model.dtype)} over {transport}")


async def _pull_and_run(s: ReceiverState, holder: schemas.CacheAvailable, items: list[PullItem], layout: Layout,
                        arriving: ArrivingSource, engine_source: Watched, steps: Steps[Generation], timeout_s: float,
                        deadline: float | None, codec: str, codec_params: schemas.CodecParams) -> ReuseOutcome:
    """One pull of `items` into `arriving` while the engine's `steps` run on the torch thread,
    waiting on `engine_source` (the arriving source itself, or what reads it)."""
    stamps: dict[str, float] = {}
    until = time.monotonic() + timeout_s

    async def pull() -> int:
        try:
            async with asyncio.timeout(timeout_s):
                await s.pull_slots.acquire()
        except TimeoutError as e:
            err = TransferError(f"no pull slot free within {timeout_s:.3g}s ({s.cfg.max_concurrent_pulls} pulls in flight)")
            arriving.fail(err)
            raise err from e
        stamps["pull_start"] = time.perf_counter()
        try:
            token = await request_grant(s.bus.request, holder, max(0.01, until - time.monotonic()))  # part of the pull
            stamps["grant_done"] = time.perf_counter()
            return await pull_into(s.bulk, holder, items, layout, arriving, max(0.01, until - time.monotonic()),
                                   token=token, codec=codec, codec_params=codec_params)
        except BaseException as e:
            arriving.fail(e)
            raise
        finally:
            s.pull_slots.release()
            stamps["pull_done"] = time.perf_counter()

    pull_task = asyncio.get_running_loop().create_task(pull())
    try:
        busy: list[float] = []
        gen = await drive_engine(steps, engine_source, functools.partial(s.run_torch, deadline=deadline), stamps, busy,
                                 decode=s.batcher.decode)
    except BaseException:
        pull_task.cancel()
        await asyncio.gather(pull_task, return_exceptions=True)
        raise
    pulled = await pull_task  # done: the engine consumed every layer it asked for
    for key, at in arriving.arrived_at.items():
        stamps[f"arrived_{key}"] = at
    for stage, rel in gen.prefill.stages.items():  # on the clock of the arrivals: the prefill's own start
        stamps[stage] = gen.prefill.started_at + rel
    stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
    return ReuseOutcome(gen, pulled, stamps, sum(busy))
