"""Scoring a translated pair: how much of a target's quality a source's translated context keeps,
and what it saves (`droidmesh eval --translator`).

Per row (both models tokenize the row with their own tokenizer, `text.context_spans`):
  1. the source prefills the context once, keeping E at the layers the translator reads;
  2. the target answers by
       receiver_full_prefill             its own prefill of context + question,
       translated                        translated KV at every layer (`TranslatedSource`, full reuse),
       translated_recompute_[0,k)        layers [0, k) recomputed from its own embeddings, the
                                         rest translated, for each k asked,
       receiver_alone_without_context    the question alone (what the context is worth),
     and the source answers by its own full prefill (sender_alone);
     each path's `fidelity`: its answer scored (the task's metric) against the target's own full
     prefill answer, not the reference: what the path keeps of the target's own behaviour;
  3. each path's time to first token is measured on the target (translation included), so
     `prefill_cost_saved` = 1 - TTFT(translated) / TTFT(full prefill), medians over rows, and
     `translation_share` = the translation's own compute / TTFT(full prefill).
Bytes moved: the source E the translator reads against the target's own KV of the context.
Each path's `vs_full_prefill`: its task scores' paired difference to the target's full prefill on
the same rows, relative, with a bootstrap 95 % interval (a document's rows resampled together)
and the 5 % rule applied to it (`intervals.Paired.verdict`); `per_row` keeps every row's scores.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.kv.translate import TranslatedSource, Translator, align
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.text import context_spans, question_ids
from droidmesh.shared.tasks import intervals, measures
from droidmesh.shared.tasks.rows import decode_answer, document_id
from droidmesh.shared.tasks.spec import TaskSpec


def _answer(model: ModelAdapter, prompt: list[int], plan: ReusePlan, source: Any, spec: TaskSpec,
            answers: Sequence[str]) -> tuple[float, float, str]:
    """(task score, TTFT seconds, the answer's text) of `model` answering `prompt` per `plan`."""
    gen = generate(model, prompt, plan, source, max_new_tokens=spec.max_new_tokens,
                   eos_token_id=getattr(model.tokenizer, "eos_token_id", None))
    text = decode_answer(model.tokenizer, gen.tokens, spec)
    return measures.score(spec.metric, text, answers), gen.ttft_s, text


def evaluate_translated(source: ModelAdapter, target: ModelAdapter, translator: Translator, rows: Sequence[dict[str, Any]],
                        spec: TaskSpec, ks: Sequence[int] = (1, 2), progress: bool = True) -> dict[str, Any]:
    """The eval JSON of a translated pair (module docstring)."""
    translator.check_models(source.fingerprint, target.fingerprint)
    translator = translator.to(target.device)
    plans = {"translated": ReusePlan.full_reuse()} | {
        f"translated_recompute_[0,{k})": ReusePlan.recompute(0, k) for k in ks if 0 < k < target.num_layers}
    scores: dict[str, list[float]] = {name: [] for name in ["receiver_full_prefill", "sender_alone",
                                                             "receiver_alone_without_context", *plans]}
    ttft: dict[str, list[float]] = {name: [] for name in ["receiver_full_prefill", *plans]}
    fidelity: dict[str, list[float]] = {name: [] for name in ["receiver_alone_without_context", *plans]}
    translate_s: list[float] = []
    e_bytes: list[int] = []
    kv_bytes: list[int] = []
    for row in tqdm(rows, desc=f"eval {spec.name} (translated)", unit="row", disable=not progress):
        s_ctx, s_spans = context_spans(source.tokenizer, row["context"])
        t_ctx, t_spans = context_spans(target.tokenizer, row["context"])
        s_q, t_q = question_ids(source.tokenizer, row["input"]), question_ids(target.tokenizer, row["input"])
        answers = row["answers"]
        spans = align(s_spans, t_spans)
        captured = capture_prefill(source, s_ctx, e_layers=translator.source_layers)
        e_bytes.append(sum(captured.e[l].numel() * captured.e[l].element_size() for l in translator.source_layers))
        kv_bytes.append(2 * target.num_layers * math.prod(target.kv_shape(len(t_ctx))) * target.dtype.itemsize)
        q, t, own = _answer(target, t_ctx + t_q, ReusePlan.full_prefill(), None, spec, answers)
        scores["receiver_full_prefill"].append(q)
        ttft["receiver_full_prefill"].append(t)
        scores["sender_alone"].append(_answer(source, s_ctx + s_q, ReusePlan.full_prefill(), None, spec, answers)[0])
        q, _, said = _answer(target, t_ctx[:1] + t_q, ReusePlan.full_prefill(), None, spec, answers)
        scores["receiver_alone_without_context"].append(q)
        fidelity["receiver_alone_without_context"].append(measures.score(spec.metric, said, [own]))
        for name, plan in plans.items():
            src = TranslatedSource(CapturedSource(captured), translator, target, t_ctx, spans, source.fingerprint)
            q, t, said = _answer(target, t_ctx + t_q, plan, src, spec, answers)
            scores[name].append(q)
            ttft[name].append(t)
            fidelity[name].append(measures.score(spec.metric, said, [own]))
        translate_s.append(_translation_time(translator, target, captured, t_ctx, spans, source))
    full_ttft = statistics.median(ttft["receiver_full_prefill"])
    out: dict[str, Any] = {"kind": "translate", "task": spec.name, "metric": spec.metric, "rows": len(rows),
                           "source_layers": translator.source_layers, "translator": translator.info}
    for name, vals in scores.items():
        out[name] = {"quality": statistics.fmean(vals)}
        if name in ttft:
            out[name]["ttft_s"] = statistics.median(ttft[name])
        if name in fidelity:
            out[name]["fidelity"] = statistics.fmean(fidelity[name])
    out["prefill_cost_saved"] = 1 - out["translated"]["ttft_s"] / full_ttft
    for name in plans:
        out[name]["prefill_cost_saved"] = 1 - out[name]["ttft_s"] / full_ttft
    out["translation_share"] = statistics.median(translate_s) / full_ttft
    out["bytes_moved"] = {"source_e": statistics.fmean(e_bytes), "target_kv": statistics.fmean(kv_bytes)}
    _add_intervals(out, scores, [document_id(r["context"]) for r in rows])
    return out


def _add_intervals(out: dict[str, Any], scores: dict[str, list[float]], documents: list[str]) -> None:
    """Every path's paired interval against the target's full prefill (by document), and the
    rows' scores (`per_row`: path -> one score per row, in the rows' order)."""
    reference = scores["receiver_full_prefill"]
    for name, vals in scores.items():
        if name == "receiver_full_prefill":
            continue
        out[name]["vs_full_prefill"] = intervals.versus_json(
            intervals.paired(reference, vals, n_boot=2000, groups=documents))
    out["documents"] = len(set(documents))
    out["per_row"] = {name: [round(v, 4) for v in vals] for name, vals in scores.items()}


@torch.inference_mode()
def _translation_time(translator: Translator, target: ModelAdapter, captured: Any, t_ctx: list[int],
                      spans: list[tuple[int, int]], source: ModelAdapter) -> float:
    """Seconds to translate every target layer's KV of one context (steps 2-4 alone)."""
    src = TranslatedSource(CapturedSource(captured), translator, target, t_ctx, spans, source.fingerprint)
    start = time.perf_counter()
    for layer in range(target.num_layers):
        src.kv(layer, float("inf"))
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return time.perf_counter() - start
