"""Decoding after a prefill: one request's state (`Decoding`) and one step for many (`step`).

A request's prefill (full, partial with its own plan, translated; `partial.py`) ends with its
first token chosen and its cache holding the whole prompt. From there each decode step feeds the
last chosen token and chooses the next. `step` does that for any number of requests at once, as
one forward: the weights are read once for the whole batch, which on a CPU (and on a GPU at these
sizes) is what a step of one sequence spends its time on. Each request keeps its own cache
(written once), sampler, stops, `max_new_tokens` and deadline; rows attend over their own caches
(`ModelAdapter.decode`), so requests of any lengths and plans share a step.

A request whose step fails in its own code (its sampler, its `on_token`) finishes with that error
(`Decoding.error`) and the others go on; a failure of the forward itself fails that step's rows.
With one row, or a model that cannot batch (`ModelAdapter.batches`), a step is exactly the solo
path: `run_layers` over the one token. With a decode pool (`shared/kv/pool.py`) the rows that
fit decode in its slots instead: the step's shapes fixed per bucket, replayable as a CUDA graph.

Pure numeric core: blocking torch calls on the caller's (the compute) thread, no I/O.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from droidmesh.shared.model.sampling import Sampler
from droidmesh.shared.wire.schemas import FinishReason

if TYPE_CHECKING:
    from droidmesh.shared.kv.pool import KVPool
    from droidmesh.shared.model.adapter import ModelAdapter


Alternative = tuple[int, float]  # (token id, log-probability)
Logprob = tuple[int, float, list[Alternative]]  # a chosen token, its log-probability, the top alternatives


@dataclasses.dataclass(eq=False)
class Decoding:
    """One request's decoding: its cache holds `past` tokens (the prompt and every chosen token
    but the last), `tokens[-1]` is the last chosen and not yet fed. `finish` is set once it ends:
    "stop" (EOS, or `on_token` said stop), "length" (`max_new_tokens`, its deadline, or `cancel`).
    With `logprobs_k` (0..20), `logprobs` gets, per chosen token, its log-probability under the
    model's next-token distribution (before temperature) and the `logprobs_k` most likely tokens'."""

    cache: Any
    past: int
    max_new_tokens: int
    eos_token_id: int | None
    sampler: Sampler
    on_token: Callable[[int], bool] | None = None
    deadline: float | None = None  # time.monotonic(); checked before each of its steps
    logprobs_k: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    error: BaseException | None = None  # what ended it when its own sampler or on_token raised
    widest: int = 1  # the most rows a step it took part in had

    @property
    def done(self) -> bool:
        return self.finish is not None

    def cancel(self) -> None:
        """Leave at the next step with what it has (its client left, its budget is spent)."""
        if self.finish is None:
            self.finish = "length"

    def take(self, row: torch.Tensor) -> None:
        """Choose the next token from its logits [vocab] (the first: the prefill's last row) and
        hand it to `on_token`; end if it is EOS, `on_token` said stop, or the limit is reached."""
        token = self.sampler(row)
        self.tokens.append(token)
        if self.logprobs_k is not None:
            lp = torch.log_softmax(row.float(), dim=-1)  # [vocab]
            top = lp.topk(self.logprobs_k) if self.logprobs_k else None
            alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
            self.logprobs.append((token, float(lp[token]), alternatives))
        go = self.on_token is None or self.on_token(token)
        if not go or token == self.eos_token_id:
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish = "length"


def step(model: ModelAdapter, rows: Sequence[Decoding], pool: KVPool | None = None) -> float:
    """One decode step of every unfinished row in `rows`, as one forward. A row past its deadline
    leaves first (finish "length"). Afterwards each row has one more token or has finished.
    With a decode `pool` (`shared/kv/pool.py`, the same model's), rows that fit step in its
    slots and the rest beside them; a finished row leaves its slot. Returns the step's seconds
    (0 when no row was left to step)."""
    now = time.monotonic()
    for d in rows:
        if not d.done and d.deadline is not None and now >= d.deadline:
            d.cancel()
    live = [d for d in rows if not d.done]
    began = time.perf_counter()
    with torch.inference_mode():
        if pool is not None:
            pool.release(rows)
            pooled = [d for d in live if pool.admit(d)]
            if pooled:
                try:
                    logits = pool.step(pooled)  # [B, vocab]
                except BaseException:  # the step's rows fail (the caller's to say): their caches back, slots free
                    pool.release(pooled, every=True)
                    raise
                for d, row in zip(pooled, logits, strict=True):
                    d.past += 1
                    _choose(d, row)
            in_pool = {id(d) for d in pooled}
            rest = [d for d in live if id(d) not in in_pool]
        else:
            rest = live
        if len(rest) == 1 or not model.batches:
            for d in rest:  # the solo path: one row's token through every layer
                h = model.run_layers(model.embed(model.token_tensor(d.tokens[-1:])), 0, model.num_layers, d.cache,
                                     past=d.past)  # [1, 1, D]
                d.past += 1
                _choose(d, model.logits(h)[0, -1])  # [1, 1, vocab] -> [vocab]
        elif rest:
            h = model.decode([d.tokens[-1] for d in rest], [d.cache for d in rest], [d.past for d in rest])  # [B, 1, D]
            logits = model.logits(h)[:, -1]  # [B, 1, vocab] -> [B, vocab]
            for d, row in zip(rest, logits, strict=True):
                d.past += 1
                _choose(d, row)
        if pool is not None:
            pool.release(rows)
    if not live:
        return 0.0
    for d in live:
        d.widest = max(d.widest, len(live))
    return time.perf_counter() - began


def _choose(d: Decoding, row: torch.Tensor) -> None:
    """Row `d`'s next token; its own sampler or callback failing ends it alone."""
    try:
        d.take(row)
    except Exception as e:
        d.error, d.finish = e, "stop"
