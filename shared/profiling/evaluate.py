"""Quality of a reuse plan for one sender -> receiver pair over LongBench-style rows.

The one place plans are scored (used by `droidmesh eval` and by the profiler). For each row the
sender prefills the context once, keeping E at every layer (any group may be asked for), and
each plan is then run by the receiver on context + question with greedy decoding; the task
metric scores the decoded answer. Fidelity beside it: the gold answer's NLL under the plan, and
KL / top-1 agreement of the receiver's next-token distributions at the answer positions
against its own full prefill.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from shared.kv.blocks import CapturedContext
from shared.kv.capture import capture_prefill
from shared.kv.partial import generate, prefill
from shared.kv.plan import ReusePlan
from shared.kv.sources import CapturedSource
from shared.model.adapter import ModelAdapter
from shared.zoo import metrics
from shared.zoo.suite import TaskSpec, decode_answer, encode_row


@dataclasses.dataclass(frozen=True)
class Encoded:
    context: list[int]
    question: list[int]
    answer: list[int]
    answers: tuple[str, ...]


class PairEvaluator:
    """Scores plans for (sender, receiver) on `rows`; every result is memoised per plan."""

    def __init__(self, sender: ModelAdapter, receiver: ModelAdapter, rows: list[dict[str, Any]], spec: TaskSpec):
        if not rows:
            raise ValueError("no rows to evaluate on")
        self.sender, self.receiver, self.spec = sender, receiver, spec
        self.rows = [Encoded(*encode_row(receiver.tokenizer, r, spec), tuple(r["answers"])) for r in rows]
        self._captured: dict[int, CapturedContext] = {}
        self._quality: dict[ReusePlan, float] = {}
        self._reference: dict[int, torch.Tensor] = {}

    @property
    def num_layers(self) -> int:
        return self.receiver.num_layers

    def _capture(self, i: int) -> CapturedContext:
        if i not in self._captured:
            self._captured[i] = capture_prefill(self.sender, self.rows[i].context, range(self.sender.num_layers))
        return self._captured[i]

    def _answer(self, model: ModelAdapter, i: int, plan: ReusePlan) -> str:
        row = self.rows[i]
        source = None if plan.mode == "full_prefill" else CapturedSource(self._capture(i))
        gen = generate(model, row.context + row.question, plan, source, max_new_tokens=self.spec.max_new_tokens,
                       eos_token_id=model.tokenizer.eos_token_id)
        return decode_answer(model.tokenizer, gen.tokens, self.spec)

    def quality(self, plan: ReusePlan) -> float:
        """Mean task score of the receiver under `plan` (in [0, 1])."""
        if plan not in self._quality:
            scores = [metrics.score(self.spec.metric, self._answer(self.receiver, i, plan), r.answers)
                      for i, r in enumerate(self.rows)]
            self._quality[plan] = statistics.fmean(scores)
        return self._quality[plan]

    __call__ = quality

    def sender_alone(self) -> float:
        """The sender answering the receiver's task by itself (its own full prefill)."""
        return statistics.fmean(metrics.score(self.spec.metric, self._answer(self.sender, i, ReusePlan.full_prefill()),
                                              r.answers) for i, r in enumerate(self.rows))

    def _answer_logits(self, i: int, plan: ReusePlan) -> torch.Tensor:
        """[A, vocab] logits predicting each gold answer token under `plan`."""
        row = self.rows[i]
        source = None if plan.mode == "full_prefill" else CapturedSource(self._capture(i))
        res = prefill(self.receiver, row.context + row.question + row.answer, plan, source)
        a = len(row.answer)
        return res.logits[-a - 1 : -1]  # logits[j] predicts suffix token j + 1

    def fidelity(self, plan: ReusePlan) -> dict[str, float]:
        """Gold-answer NLL, and KL / top-1 agreement against the receiver's full prefill."""
        nll, kl, top1 = [], [], []
        for i, row in enumerate(self.rows):
            if not row.answer:
                continue
            if i not in self._reference:
                self._reference[i] = self._answer_logits(i, ReusePlan.full_prefill())
            ref, got = self._reference[i], self._answer_logits(i, plan)
            nll.append(metrics.answer_nll(got, row.answer))
            kl.append(metrics.kl_divergence(ref, got))
            top1.append(metrics.top1_agreement(ref, got))
        return {"answer_nll": statistics.fmean(nll), "kl": statistics.fmean(kl), "top1_agreement": statistics.fmean(top1)}
