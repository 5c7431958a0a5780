"""Partial prefill (receiver side): run the receiver over a context whose KV came from a sender.

Sequence for a prompt P whose first m tokens are the sender's cached context (m = longest common
token prefix, leaving >= 1 token to compute):
  1. for each patch layer l (SCD): wait for E_l, which arrives decoded into the receiver's
     normalized attention input at l, and project it to layer l's K/V (`project_kv`, no
     attention, no MLP); then for each recompute group [s, e): wait for the sender's E_s only (s = 0 needs nothing: its
     input is the receiver's own embedding), then run receiver layers s..e-1 over the m context
     tokens (positions 0..m-1) -> receiver KV of layers s..e-1.
     (cacheblend instead recomputes a share of tokens through all layers, see `blend.py`;
     the swap probe runs the receiver over the whole context and leaves step 2 to replace
     the listed layers with the sender's KV.)
  2. the suffix P[m:] runs through all receiver layers at positions m.. ; before layer l it waits
     for layer l's KV only (reused layers: the sender's, checked and sliced to m tokens).
  3. decoding continues from the suffix's last logits on the assembled cache (`decode.py`): each
     token is chosen by the request's sampler (`shared/model/sampling.py`; greedy argmax by
     default) and handed to `on_token` (streaming, stop sequences) on the compute thread;
     decoding ends at EOS or when `on_token` says stop (finish_reason "stop"), or at
     max_new_tokens ("length"). The steps yield a "decode" `Need` carrying the request's
     `Decoding` first: a driver that batches decodes it there with other requests (continuous
     batching); otherwise it decodes alone.
Step 1 needs no reused KV at all, so a transport that delivers E first overlaps the recompute
with the KV transfer. Each function has a steps form (`prefill_steps`, `generate_steps`) that
yields a `Need` before every source read, so a service can wait for arriving layers off its
compute thread (see `shared/kv/sources.py`); `prefill` / `generate` drive it in place.
Every delivered tensor is checked before use (shape, dtype, and the receiver's device: the engine
never copies across devices, and builds its own tensors there) and the cache is private to the
call: on any error nothing is half-applied, the caller falls back to full prefill.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from droidmesh.shared.errors import BadRequestError, ReuseError
from droidmesh.shared.kv import decode
from droidmesh.shared.kv.blend import blend_steps
from droidmesh.shared.kv.blocks import check_kv, check_tensor, reusable_prefix
from droidmesh.shared.kv.decode import Decoding, Logprob
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import LayerSource, Need, Steps, run_steps
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.fingerprint import require_compatible
from droidmesh.shared.model.sampling import Sampler, greedy
from droidmesh.shared.wire.schemas import FinishReason

DEFAULT_TIMEOUT_S = 30.0
# Decoded tokens a cache reserves room for up front; a longer answer grows it (doubling), so a
# huge max_new_tokens never allocates before a token exists.
DECODE_RESERVE = 1024
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs bound)
MAX_SAMPLES = 16  # samples (OpenAI's n) per request: each holds a copy of the prompt's cache
P = ParamSpec("P")
T = TypeVar("T")


@dataclasses.dataclass
class PrefillResult:
    cache: Any  # the assembled receiver cache, all layers at len(prompt) tokens
    logits: torch.Tensor  # [n, vocab] float32 for the last n = min(logits_for, computed) prompt tokens
    prompt_tokens: int
    reused_tokens: int  # m: context tokens taken from the sender
    plan: ReusePlan
    stages: dict[str, float]  # seconds since the call began, per stage boundary
    # E_l at each layer `keep_e` asked for (what a holder offers with its KV): [1, T, D] of every
    # prompt token after a full prefill; [1, T - m, D] of the computed suffix after a reuse
    e: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    started_at: float = 0.0  # time.perf_counter() when the call began: `stages` are seconds after it


@dataclasses.dataclass
class Sample:
    """One more sample of a request that asked for several (`generate_steps`' `samples`)."""

    tokens: list[int]
    finish_reason: FinishReason
    logprobs: list[Logprob] | None = None


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # every chosen token, the one that stopped decoding (EOS, a stop) included
    prefill: PrefillResult
    ttft_s: float  # call start -> first token chosen
    total_s: float
    finish_reason: FinishReason = "length"  # "stop": EOS or on_token stopped; "length": max_new_tokens
    decode_batch: int = 1  # the most requests a decode step of this one ran with (continuous batching)
    logprobs: list[Logprob] | None = None  # per token: (id, log-probability, top alternatives), when asked
    samples: list[Sample] = dataclasses.field(default_factory=list)  # the request's other samples, in order


def prefill_steps(
    receiver: ModelAdapter,
    prompt_ids: Sequence[int],
    plan: ReusePlan,
    source: LayerSource | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    logits_for: int = 1,
    decode_tokens: int = 0,
    turns: bool = False,
    keep_e: Sequence[int] = (),
) -> Steps[PrefillResult]:
    """`prefill` as steps: yields a `Need` before each read from `source` (run under
    `torch.inference_mode` by the driver). Logits are computed for the last `logits_for` prompt
    tokens only: 1 to serve (the next token); more for fidelity metrics over a question. At 32K
    tokens and a 128K vocabulary, logits for every token would be 16.8 GB of float32.
    The cache is sized for the prompt plus the `decode_tokens` the caller will append (at most
    DECODE_RESERVE up front), and every token's K/V is written into it once
    (`hf_cache.WriteOnceLayer`). With `turns`, a full prefill yields a "turn" `Need` between
    layers (a background run a driver can pause for a request; the result is the same). With
    `keep_e`, the prefill keeps E_l of each of those layers for the tokens it computes (a copy:
    the layers' outputs are not kept otherwise; after a reuse, the suffix's), so its cache and E
    can be held for others to reuse; same result."""
    if logits_for < 1:
        raise BadRequestError(f"logits_for {logits_for} < 1")
    t0 = time.perf_counter()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise BadRequestError("empty prompt")
    L = receiver.num_layers
    plan.validate(L)
    receiver.check_length(len(prompt))
    stages: dict[str, float] = {}
    cache = receiver.new_cache(len(prompt) + min(max(decode_tokens, 0), DECODE_RESERVE))
    if plan.mode == "full_prefill":
        return (yield from _full_prefill(receiver, prompt, plan, cache, logits_for, turns, keep_e, stages, t0))
    if source is None:
        raise BadRequestError(f"plan {plan.label()} needs a sender cache")
    require_compatible(source.fingerprint, receiver.fingerprint)
    m = reusable_prefix(source.token_ids, prompt)
    if m == 0:
        raise ReuseError("the sender's context shares no token prefix with the prompt")
    deadline = time.monotonic() + timeout_s
    filled = yield from fill_context(receiver, prompt[:m], plan, source, cache, deadline, stages, t0)
    h, suffix_e = yield from _run_suffix(receiver, prompt[m:], m, source, cache, filled, deadline, keep_e, stages, t0)
    stages["suffix_done"] = time.perf_counter() - t0
    return PrefillResult(cache, receiver.logits(h[:, -logits_for:])[0], len(prompt), m, plan, stages,
                         suffix_e, t0)  # logits [n, vocab]


def _full_prefill(
    receiver: ModelAdapter,
    prompt: list[int],
    plan: ReusePlan,
    cache: Any,
    logits_for: int,
    turns: bool,
    keep_e: Sequence[int],
    stages: dict[str, float],
    t0: float,
) -> Steps[PrefillResult]:
    """The whole prompt through every layer, nothing reused: run in segments cut at each kept E
    (snapshotted between them) and, with `turns`, at every layer (a "turn" `Need` between)."""
    L = receiver.num_layers
    h = receiver.embed(receiver.token_tensor(prompt))  # [1, T, D]
    kept = sorted({l for l in keep_e if 0 <= l < L})
    cuts = sorted({0, L, *kept} if not turns else set(range(L + 1)))  # segment bounds: run, snapshot, run
    e_kept: dict[int, torch.Tensor] = {}
    for s, e in itertools.pairwise(cuts):
        if s and turns:
            yield Need("turn", s, float("inf"))
        if s in kept:
            e_kept[s] = h.clone()  # E_s [1, T, D]: the next layers write new tensors, never this one
        h = receiver.run_layers(h, s, e, cache, past=0)
    stages["suffix_done"] = time.perf_counter() - t0
    return PrefillResult(cache, receiver.logits(h[:, -logits_for:])[0], len(prompt), 0, plan, stages,
                         e_kept, t0)  # logits [n, vocab]


def _run_suffix(
    receiver: ModelAdapter,
    suffix: list[int],
    m: int,
    source: LayerSource,
    cache: Any,
    filled: list[bool],
    deadline: float,
    keep_e: Sequence[int],
    stages: dict[str, float],
    t0: float,
) -> Steps[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """Step 2: the suffix (positions m..) through all layers; layer l waits only for layer l's KV,
    the sender's (checked, sliced to the m context tokens) where step 1 left it unfilled. Returns
    E_L of the suffix [1, S, D] and the suffix's E at each `keep_e` layer."""
    h = receiver.embed(receiver.token_tensor(suffix))  # [1, S, D]
    full = len(source.token_ids)
    suffix_e: dict[int, torch.Tensor] = {}
    for layer in range(receiver.num_layers):
        if layer in keep_e:
            suffix_e[layer] = h.clone()  # E_layer of the suffix tokens only [1, S, D]
        if not filled[layer]:
            yield Need("kv", layer, deadline)
            block = source.kv(layer, deadline)
            check_kv(block, layer, receiver.kv_shape(full), receiver.dtype, receiver.device)
            hf_cache.set_layer_kv(cache, layer, block.k[:, :, :m], block.v[:, :, :m])  # [1, kvh, m, hd]
            stages["kv_last_ready"] = time.perf_counter() - t0
        h = receiver.run_layers(h, layer, layer + 1, cache, past=m)
    return h, suffix_e


def fill_context(
    receiver: ModelAdapter,
    context: list[int],
    plan: ReusePlan,
    source: LayerSource,
    cache: Any,
    deadline: float,
    stages: dict[str, float],
    t0: float,
) -> Steps[list[bool]]:
    """Step 1: compute the receiver's own context KV where the plan says so; return which
    layers of `cache` now hold the context."""
    L, m = receiver.num_layers, len(context)
    filled = [False] * L
    if plan.mode == "cacheblend":
        stages["recompute_start"] = time.perf_counter() - t0
        yield from blend_steps(receiver, context, source, plan.ratio, cache, deadline)
        stages["recompute_done"] = time.perf_counter() - t0
        return [True] * L
    if plan.mode == "swap":  # probe: the receiver's own context KV, then step 2 swaps the listed layers
        receiver.run_layers(receiver.embed(receiver.token_tensor(context)), 0, L, cache, past=0)  # [1, m, D] in
        swapped = set(plan.reused_layers(L))
        return [l not in swapped for l in range(L)]
    full = len(source.token_ids)
    for layer in plan.patch:
        yield Need("e", layer, deadline)
        x = source.e(layer, deadline)  # decoded: the receiver's normalized attention input at `layer`
        check_tensor(f"patch input of layer {layer}", x, receiver.e_shape(full), receiver.dtype, receiver.device)
        stages.setdefault("recompute_start", time.perf_counter() - t0)
        k, v = receiver.project_kv(x[:, :m], layer)  # [1, m, D] -> each [1, kvh, m, hd]
        hf_cache.set_layer_kv(cache, layer, k, v)
        filled[layer] = True
    for s, e in plan.groups:
        if s == 0:  # layer 0's input is the receiver's own embedding: exact and local
            h = receiver.embed(receiver.token_tensor(context))  # [1, m, D]
        else:
            yield Need("e", s, deadline)
            e_s = source.e(s, deadline)
            check_tensor(f"E of layer {s}", e_s, receiver.e_shape(full), receiver.dtype, receiver.device)
            h = e_s[:, :m]  # E_s [1, full, D] -> the m reused context tokens [1, m, D]
        stages.setdefault("recompute_start", time.perf_counter() - t0)
        receiver.run_layers(h, s, e, cache, past=0)
        for layer in range(s, e):
            filled[layer] = True
    if plan.groups or plan.patch:
        stages["recompute_done"] = time.perf_counter() - t0
    assert all(hf_cache.seq_length(cache, l) == m for l in range(L) if filled[l])
    return filled


def generate_steps(
    receiver: ModelAdapter,
    prompt_ids: Sequence[int],
    plan: ReusePlan,
    source: LayerSource | None = None,
    *,
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sampler: Sampler | None = None,
    on_token: Callable[[int], bool] | None = None,
    deadline: float | None = None,
    turns: bool = False,
    keep_e: Sequence[int] = (),
    logprobs: int | None = None,
    samples: Sequence[tuple[Sampler, Callable[[int], bool] | None]] = (),
) -> Steps[Generation]:
    """`generate` as steps (only the prefill reads the source; decoding is one step).

    `sampler` picks each token from its logits [vocab] (None: greedy argmax); `on_token` is
    called with every chosen token, in order, on this (the compute) thread, and returning False
    ends decoding after that token. Both run before the next decode step starts. `deadline`
    (time.monotonic()) is checked before every decode step: once it has passed, decoding ends
    with what it has (finish_reason "length"), so a request never decodes past its deadline.
    `turns`: a "turn" `Need` between a full prefill's layers and before every decode step.
    `keep_e`: a full prefill keeps E at those layers (`prefill_steps`). `logprobs` (0..20): the
    generation carries each token's log-probability and that many alternatives (`Decoding`).
    `samples`: more samples of the same prompt, each with its own sampler and `on_token`: they
    share the prefill (their first token is drawn from its logits) and decode with the first,
    each over its own copy of the prompt's cache (`Generation.samples`)."""
    _check_generate(max_new_tokens, len(samples) + 1, logprobs)
    choose = sampler or greedy
    t0 = time.perf_counter()
    pre = yield from prefill_steps(receiver, prompt_ids, plan, source, timeout_s=timeout_s,
                                   decode_tokens=max_new_tokens - 1, turns=turns, keep_e=keep_e)  # the last chosen token is never fed back
    d = Decoding(pre.cache, pre.prompt_tokens, max_new_tokens, eos_token_id, choose, on_token, deadline, logprobs)
    more = [Decoding(hf_cache.fork(pre.cache, receiver.config, pre.prompt_tokens + min(max_new_tokens, DECODE_RESERVE)),
                     pre.prompt_tokens, max_new_tokens, eos_token_id, s_sampler, s_on_token, deadline, logprobs)
            for s_sampler, s_on_token in samples]  # each sample appends to its own copy of the prompt's K/V
    for x in (d, *more):
        x.take(pre.logits[-1])  # the first token, from the prefill's last logits [vocab]
    ttft = time.perf_counter() - t0
    rows = [x for x in (d, *more) if not x.done]
    if rows:
        yield Need("decode", -1, float("inf"), decodings=tuple(rows))  # a batching driver decodes them with others
    while any(not x.done for x in rows):  # a driver that did not: decoded here, the samples together
        if turns:
            yield Need("turn", -1, float("inf"))
        decode.step(receiver, rows)
    if d.error is not None:
        raise d.error
    assert d.finish is not None
    return Generation(tokens=d.tokens, prefill=pre, ttft_s=ttft, total_s=time.perf_counter() - t0,
                      finish_reason=d.finish, decode_batch=max(x.widest for x in (d, *more)),
                      logprobs=d.logprobs if logprobs is not None else None,
                      samples=[_sample(x, logprobs is not None) for x in more])


def _check_generate(max_new_tokens: int, n: int, logprobs: int | None) -> None:
    """Refuse what no generation serves: no token to decode, more than `MAX_SAMPLES` samples (each
    holds a copy of the prompt's cache), more alternatives per token than `MAX_LOGPROBS`."""
    if max_new_tokens < 1:
        raise BadRequestError("max_new_tokens must be >= 1")
    if n > MAX_SAMPLES:
        raise BadRequestError(f"at most {MAX_SAMPLES} samples per request, got {n}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")


def _sample(d: Decoding, logprobs: bool) -> Sample:
    if d.error is not None:
        raise d.error
    assert d.finish is not None
    return Sample(d.tokens, d.finish, d.logprobs if logprobs else None)


def _in_place(steps_fn: Callable[P, Steps[T]]) -> Callable[P, T]:
    """The blocking form of a steps function: driven to the end on the calling thread, under
    `torch.inference_mode`, every source read waiting in the source itself."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        with torch.inference_mode():
            return run_steps(steps_fn(*args, **kwargs))

    return run


prefill = _in_place(prefill_steps)
"""Prefill `prompt_ids` on `receiver` following `plan`, reusing `source`'s cached prefix."""
generate = _in_place(generate_steps)
"""Prefill per `plan`, then decode up to `max_new_tokens` (greedy unless a `sampler` is given;
stopping at EOS or when `on_token` returns False)."""
