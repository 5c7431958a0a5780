"""Task metrics (LongBench conventions) and fidelity metrics against the receiver's own prefill.

Task scores are in [0, 1] and take the max over the gold answers, as LongBench does:
  token_f1         multi-doc QA (HotpotQA / 2WikiMQA): SQuAD-normalised bag-of-tokens F1
  rouge_l          summarization (MultiNews): Rouge-L F-measure from `rouge-score`
  edit_similarity  code completion (LCC / RepoBench): rapidfuzz `fuzz.ratio` / 100 on the first
                   comment-free line of the prediction (LongBench's rule)
Fidelity metrics compare next-token distributions (logits [S, vocab]) of a reuse path with the
receiver's full prefill over the same positions. They compute on the logits' device (tensors
built here are put there) and return Python floats.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from rapidfuzz import fuzz
from rouge_score import rouge_scorer

from droidmesh.shared.tasks.spec import METRIC_NAMES

_PUNCT = set(string.punctuation)
_ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (SQuAD / LongBench)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1_one(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    return max((_f1_one(prediction, a) for a in answers), default=0.0)


def rouge_l(prediction: str, answers: Sequence[str]) -> float:
    return max((_ROUGE.score(a, prediction)["rougeL"].fmeasure for a in answers), default=0.0)


def first_code_line(prediction: str) -> str:
    """LongBench's `code_sim_score` rule: after leading newlines, the first line holding no
    backtick, `#` or `//` (a whitespace-only line counts: it scores its indentation)."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def edit_similarity(prediction: str, answers: Sequence[str]) -> float:
    line = first_code_line(prediction)
    return max((fuzz.ratio(line, a) / 100.0 for a in answers), default=0.0)


METRICS = dict(zip(METRIC_NAMES, (token_f1, rouge_l, edit_similarity), strict=True))


def score(metric: str, prediction: str, answers: Sequence[str]) -> float:
    """The task score of `prediction` (an answer text, already cut) against the gold answers."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {sorted(METRICS)}")
    return METRICS[metric](prediction, answers)


# -- fidelity ----------------------------------------------------------------------------------
def answer_nll(logits: torch.Tensor, answer_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood of `answer_ids` given logits [A, vocab] where row i is the
    distribution that predicts answer token i."""
    if len(answer_ids) == 0:
        return 0.0
    target = torch.tensor(list(answer_ids), dtype=torch.long, device=logits.device)
    return float(F.cross_entropy(logits.float()[: len(target)], target))


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(P_ref || P_other) in nats; both [S, vocab] logits."""
    ref = F.log_softmax(reference.float(), dim=-1)
    oth = F.log_softmax(other.float(), dim=-1)
    return float((ref.exp() * (ref - oth)).sum(-1).mean())


def greedy_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Share of the reference's greedy answer tokens that `other` reproduces position by position
    (a longer or shorter answer counts its extra or missing positions as disagreements)."""
    n = max(len(reference), len(other))
    return 1.0 if n == 0 else sum(a == b for a, b in zip(reference, other, strict=False)) / n


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Share of positions whose argmax token matches the reference's; both [S, vocab]."""
    return float((reference.argmax(-1) == other.argmax(-1)).float().mean())
