"""The one scorer of reuse plans: how much of a receiver's quality survives reusing a sender's KV.

Used by `droidmesh eval` (`report.evaluate_pair`), `droidmesh profile` (the search's quality
oracle), `droidmesh bench quality`, and, through `score_text`, by the demo on answers a receiver
service returned. For every row the sender prefills the context once (keeping KV and E at every
layer, so any plan can be asked for); the model under test then prefills context + question
per the plan and greedy-decodes, and the task metric scores the answer text.

Two ways to ask, over the same computation (each with an optional `Wire`: the codec the reused
tensors travel under, applied in process by `CodedSource`; default raw, i.e. the tensors as captured):
  quality(plan)   mean task score, memoised per (plan, wire); plan-major, so the captured sender
                  contexts are kept (the profiler's search asks for plans one at a time);
                  `scores(plan, rows=n)` scores only the first n rows (a sequential test asks
                  for more rows as it goes, and a row is never scored twice)
  divergences(plan)  per row, the fidelity signal: the receiver's next-token KL(full prefill ||
                  plan), teacher-forced over the receiver's own full-prefill greedy answer (no
                  generation per plan, no gold answer needed; a continuous number on every row,
                  where task scores tie)
  paths(plans)    row-major, one capture per row at a time: per plan the task score, the gold
                  answer's mean NLL (teacher-forced after the same prefill) and the KL / top-1
                  agreement of its next-token distributions against the receiver's full
                  prefill over the same positions (the eval table)
The per-layer probes are both plans scored here: `per_layer_plan(l)` ("reuse only layer l":
[0,l) and [l+1,L) recomputed, layer l+1 from the sender's E: the eval table) and
`ReusePlan.swap([l])` (only layer l's KV swapped into the receiver's own prefill, no E: the
profiler's sensitivity, see `shared/profiling/search.py`).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.kv.blocks import CapturedContext
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.tasks import measures
from droidmesh.shared.tasks.rows import answer_text, decode_answer, document_id, encode_row
from droidmesh.shared.tasks.spec import TaskSpec
from droidmesh.shared.transport.inproc import CodedSource
from droidmesh.shared.wire.schemas import CodecParams


@dataclasses.dataclass(frozen=True)
class Encoded:
    context: list[int]
    question: list[int]
    answer: list[int]
    answers: tuple[str, ...]

    @property
    def prompt(self) -> list[int]:
        return self.context + self.question

    @property
    def suffix(self) -> int:
        """Prompt tokens every plan computes itself (at least one: the sender holds the context)."""
        return len(self.prompt) - min(len(self.context), len(self.prompt) - 1)


@dataclasses.dataclass(frozen=True)
class Wire:
    """How the reused tensors travel: a registered codec and its params (hashable, for memos)."""

    codec: str = "raw"
    params: tuple[tuple[str, int | float | str], ...] = ()

    @staticmethod
    def of(codec: str, params: CodecParams | None = None) -> Wire:
        return Wire(codec, tuple(sorted((params or {}).items())))


RAW = Wire()


@dataclasses.dataclass
class PathResult:
    """One plan on one row: answer text, task score, gold NLL, and the logits fidelity compares
    ([suffix + len(answer) - 1, vocab]: the computed prompt positions, then the answer's)."""

    prediction: str
    quality: float
    nll: float
    logits: torch.Tensor
    tokens: tuple[int, ...] = ()  # the greedy answer's token ids (fidelity: agreement with full prefill's)


def per_layer_plan(layer: int, num_layers: int) -> ReusePlan:
    """Reuse only `layer`: recompute everything below and above it."""
    groups = [(s, e) for s, e in ((0, layer), (layer + 1, num_layers)) if e > s]
    return ReusePlan.recompute_groups(groups)


def score_text(spec: TaskSpec, text: str, answers: Sequence[str]) -> float:
    """The task score of a generated text (cut and stripped as the task says)."""
    return measures.score(spec.metric, answer_text(text, spec), answers)


class PairScorer:
    """Scores plans for (sender, receiver) on `rows` of one task; blocks (torch, CPU or GPU)."""

    def __init__(self, sender: ModelAdapter, receiver: ModelAdapter, rows: Sequence[dict[str, Any]], spec: TaskSpec,
                 *, max_captures: int | None = None):
        """`max_captures`: keep at most this many rows' captures (least recently used go, and are
        made again when asked): a real-tier row's capture is ~150 MB in float32, and a profile of
        64 rows would otherwise hold ~10 GB. None: keep every one."""
        if not rows:
            raise ValueError("no rows to score on")
        self.sender, self.receiver, self.spec = sender, receiver, spec
        self.rows = [Encoded(*encode_row(receiver.tokenizer, r, spec), tuple(r["answers"])) for r in rows]
        self.ids = [r.get("_id") for r in rows]
        self.documents = [document_id(r["context"]) for r in rows]  # an interval resamples a document's rows together
        self._captured: collections.OrderedDict[int, CapturedContext] = collections.OrderedDict()  # LRU order
        self.max_captures = max_captures
        # per-row scores, not only their mean: the profiler asks whether paths differ on any row
        self._scores: dict[tuple[ReusePlan, Wire], list[float]] = {}
        self._sender: list[float] | None = None
        self._divergences: dict[tuple[ReusePlan, Wire], list[float]] = {}
        self._reference: dict[int, tuple[list[int], torch.Tensor]] = {}  # row -> (answer ids, log-probs [A, vocab])

    @property
    def num_layers(self) -> int:
        return self.receiver.num_layers

    def scores(self, plan: ReusePlan, wire: Wire = RAW, rows: int | None = None) -> list[float]:
        """The receiver's task score under `plan` on each row (the first `rows`), in order;
        memoised per (plan, wire) and row."""
        got = self._scores.setdefault((plan, wire), [])
        for i in range(len(got), self._upto(rows)):
            capture = None if plan.mode == "full_prefill" else self._kept_capture(i)
            got.append(self._score(self.receiver, i, plan, capture, wire))
        return got[:self._upto(rows)]

    def fill(self, plans: Sequence[ReusePlan], wire: Wire | None = None) -> None:
        """Score `plans` on every row, row by row: one capture per row, dropped after the row
        (unless a plan-major call kept it), so a split of any size fits in memory when its plans
        are known up front (a profile's test split: ~150 MB per real-tier row in float32)."""
        lists = {p: self._scores.setdefault((p, wire or RAW), []) for p in plans}
        for i in tqdm(range(len(self.rows)), desc=f"{len(plans)} plans, row by row", unit="row",
                      disable=all(len(got) >= len(self.rows) for got in lists.values())):
            todo = [p for p, got in lists.items() if len(got) == i]
            capture = self._captured.get(i)
            if capture is None and any(p.mode != "full_prefill" for p in todo):
                capture = self._capture(i)
            for p in todo:
                lists[p].append(self._score(self.receiver, i, p, None if p.mode == "full_prefill" else capture,
                                            wire or RAW))

    def divergences(self, plan: ReusePlan, rows: int | None = None, wire: Wire = RAW) -> list[float]:
        """Per row (the first `rows`): mean over the receiver's own full-prefill greedy answer of
        KL(full prefill's next-token distribution || `plan`'s, reused tensors sent under `wire`),
        teacher-forced, in nats; memoised."""
        got = self._divergences.setdefault((plan, wire), [])
        for i in range(len(got), self._upto(rows)):
            got.append(self._divergence(i, plan, wire))
        return got[:self._upto(rows)]

    def _upto(self, rows: int | None) -> int:
        return len(self.rows) if rows is None else max(0, min(rows, len(self.rows)))

    def quality(self, plan: ReusePlan, wire: Wire = RAW) -> float:
        """Mean task score of the receiver under `plan` (in [0, 1]), reused tensors sent under `wire`; memoised."""
        return statistics.fmean(self.scores(plan, wire))

    __call__ = quality

    def sender_scores(self) -> list[float]:
        """The sender's own task score on each row (its full prefill); memoised."""
        if self._sender is None:
            self._sender = [self._score(self.sender, i, ReusePlan.full_prefill(), None) for i in range(len(self.rows))]
        return self._sender

    def sender_alone(self) -> float:
        """The sender answering the receiver's task by itself (its own full prefill)."""
        return statistics.fmean(self.sender_scores())

    def paths(self, plans: Mapping[str, ReusePlan], *, progress: bool = False, wires: Mapping[str, Wire] | None = None,
              sender_alone: bool = True) -> Iterator[dict[str, PathResult]]:
        """Per row, in order: {"receiver_full_prefill", "sender_alone", *plans} -> PathResult
        (`wires[name]`: that plan's wire; raw otherwise; `sender_alone=False`: that path is not
        run, nor in the dict)."""
        for i in tqdm(range(len(self.rows)), desc=f"eval {self.spec.name}", unit="row", disable=not progress):
            capture = self._captured.get(i) or self._capture(i)
            full = ReusePlan.full_prefill()
            res = {"receiver_full_prefill": self._path(self.receiver, i, full, None)}
            if sender_alone:
                res["sender_alone"] = self._path(self.sender, i, full, None)
            for name, plan in plans.items():
                res[name] = self._path(self.receiver, i, plan, capture, (wires or {}).get(name, RAW))
            yield res

    # -- one row ------------------------------------------------------------------------------
    def _capture(self, i: int) -> CapturedContext:
        return capture_prefill(self.sender, self.rows[i].context, e_layers=range(self.sender.num_layers))

    def _kept_capture(self, i: int) -> CapturedContext:
        if i in self._captured:
            self._captured.move_to_end(i)
        else:
            self._captured[i] = self._capture(i)
            while self.max_captures is not None and len(self._captured) > max(1, self.max_captures):
                self._captured.popitem(last=False)
        return self._captured[i]

    @torch.inference_mode()  # decoding and teacher forcing too, not only the engine's prefill
    def _score(self, model: ModelAdapter, i: int, plan: ReusePlan, capture: CapturedContext | None,
               wire: Wire = RAW) -> float:
        row = self.rows[i]
        pre = prefill(model, row.prompt, plan, _source(plan, capture, wire, row))
        tokens = _greedy(model, pre.cache, int(pre.logits[-1].argmax()), len(row.prompt), self.spec.max_new_tokens)
        return measures.score(self.spec.metric, decode_answer(model.tokenizer, tokens, self.spec), row.answers)

    @torch.inference_mode()
    def _divergence(self, i: int, plan: ReusePlan, wire: Wire = RAW) -> float:
        if i not in self._reference:  # the receiver's own answer and its distributions over it
            pre = prefill(self.receiver, self.rows[i].prompt, ReusePlan.full_prefill(), None)
            answer = _greedy(self.receiver, pre.cache, int(pre.logits[-1].argmax()), len(self.rows[i].prompt),
                             self.spec.max_new_tokens)
            self._reference[i] = answer, self._forced(i, ReusePlan.full_prefill(), answer)
        answer, reference = self._reference[i]
        other = reference if plan.mode == "full_prefill" else self._forced(i, plan, answer, wire)
        return float((reference.exp() * (reference - other)).sum(-1).mean())

    def _forced(self, i: int, plan: ReusePlan, answer: list[int], wire: Wire = RAW) -> torch.Tensor:
        """Log-probs [len(answer), vocab] of the receiver under `plan` at the positions that predict
        each token of `answer`, the answer fed in (teacher forcing: one forward, no decoding)."""
        row, model = self.rows[i], self.receiver
        capture = None if plan.mode == "full_prefill" else self._kept_capture(i)
        pre = prefill(model, row.prompt, plan, _source(plan, capture, wire, row))
        logits = pre.logits[-1:]  # [1, vocab]: predicts answer[0]
        if len(answer) > 1:
            ids = torch.tensor([answer[:-1]], device=model.device)  # [1, A-1]
            h = model.run_layers(model.embed(ids), 0, model.num_layers, pre.cache, past=len(row.prompt))
            logits = torch.cat([logits, model.logits(h)[0]])  # [A, vocab]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def _path(self, model: ModelAdapter, i: int, plan: ReusePlan, capture: CapturedContext | None,
              wire: Wire = RAW) -> PathResult:
        """Prefill per `plan`, then (a) teacher-force the gold answer for its NLL and fidelity
        logits, (b) greedy-decode on a copy of the cache for the task score."""
        row = self.rows[i]
        pre = prefill(model, row.prompt, plan, _source(plan, capture, wire, row), logits_for=row.suffix)
        gen_cache = copy.deepcopy(pre.cache)
        ans_logits = pre.logits[-1:]  # [1, vocab] predicts answer[0]
        if len(row.answer) > 1:
            ids = torch.tensor([row.answer[:-1]], device=model.device)
            h = model.run_layers(model.embed(ids), 0, model.num_layers, pre.cache, past=len(row.prompt))
            ans_logits = torch.cat([ans_logits, model.logits(h)[0]])  # [A, vocab]
        nll = measures.answer_nll(ans_logits, row.answer)
        tokens = _greedy(model, gen_cache, int(pre.logits[-1].argmax()), len(row.prompt), self.spec.max_new_tokens)
        pred = decode_answer(model.tokenizer, tokens, self.spec)
        logits = torch.cat([pre.logits[-row.suffix:], ans_logits[1:]])
        return PathResult(pred, measures.score(self.spec.metric, pred, row.answers), nll, logits, tuple(tokens))


def _source(plan: ReusePlan, capture: CapturedContext | None, wire: Wire, row: Encoded
            ) -> CapturedSource | CodedSource | None:
    if plan.mode == "full_prefill" or capture is None:
        return None
    if wire == RAW:
        return CapturedSource(capture)
    # the prefix a receiver pulls for this prompt (per-token codes do not depend on it; int8 K scales do)
    return CodedSource(capture, wire.codec, dict(wire.params), tokens=len(row.prompt) - row.suffix)


def _greedy(model: ModelAdapter, cache: Any, first: int, past: int, n: int) -> list[int]:
    """Greedy decoding on `cache` (advanced in place) from the first token, up to `n` tokens or EOS."""
    eos = getattr(model.tokenizer, "eos_token_id", None) if model.tokenizer is not None else None
    tokens, token = [first], first
    while len(tokens) < n and token != eos:
        ids = torch.tensor([[token]], device=model.device)
        h = model.run_layers(model.embed(ids), 0, model.num_layers, cache, past=past)
        token = int(model.logits(h)[0, -1].argmax())
        tokens.append(token)
        past += 1
    return tokens
