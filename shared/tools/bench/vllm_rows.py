"""`droidmesh bench vllm-rows`: vLLM with the DroidMesh connector against vLLM alone, answer by
answer, on the real tier's test rows (doc_qa, cut from the standard library's docs).

One local mesh (`vllm_reuse.pair_mesh`: a DroidMesh sender of `real/base` holding every row's
context, the pair's plan on the config board) and `vllm serve` of `real/base` with `docqa` as a
LoRA adapter through the connector. Per row, greedy answers of the task's length:
  - same model: `base` asks, vLLM's own full prefill against full reuse of the sender's cache of
    the same weights (mode `full_reuse`): is the first token the same, and what share of the
    answer's tokens agree;
  - the pair: `docqa` asks, vLLM's own full prefill against the pair's plan (`partial`: layers
    [6, 9) recomputed from the sender's E), both scored by the task metric; DroidMesh's own engine
    scores the same plan and its own full prefill on the same rows, beside them.
Verdicts carry intervals (`tasks/intervals.py`): agreement rates a Wilson interval, quality the
paired difference to full prefill with a bootstrap interval and the 5 % rule applied to it.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from droidmesh.shared.engines.vllm.client import Engine, ServedEngine
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import free_port
from droidmesh.shared.service.localmesh import THREADS
from droidmesh.shared.tasks import intervals, measures
from droidmesh.shared.tasks.rows import decode_answer, encode_row
from droidmesh.shared.tasks.spec import TaskSpec, task_spec
from droidmesh.shared.tools.bench.vllm_reuse import PLAN, READY_S, pair_mesh

TASK = "doc_qa"


def _answer(tokens: list[int], eos: int | None) -> list[int]:
    """A greedy answer as the engine's own decoding ends it: at the first EOS, kept (the server
    is asked to ignore EOS, so every request generates the same number of tokens)."""
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def _path(engine: Engine, request_id: str) -> str:
    if engine.events("reuse_fallback", request_id):
        return "fallback"
    return ",".join(e["path"] for e in engine.events("request", request_id)) or "none"


def ask_rows(engine: Engine, tokenizer: Any, rows: Sequence[dict[str, Any]], spec: TaskSpec, *,
             adapter: str = "docqa", say: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Per row (its context held by a sender of the engine's base model): the same-model pair of
    answers (full prefill, full reuse) and the cross-model one (full prefill, the plan), with the
    connector's path of each reuse and the task score of each cross-model answer."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for i, row in enumerate(rows):
        ctx, q, _ = encode_row(tokenizer, row, spec)
        prompt = ctx + q
        asked = {}
        for key, lora, mode in (("base_alone", None, "full_prefill"), ("base_reuse", None, "full_reuse"),
                                ("pair_alone", adapter, "full_prefill"), ("pair_plan", adapter, "auto")):
            r = engine.ask(f"row{i}-{key}", prompt, max_tokens=spec.max_new_tokens, lora=lora, mode=mode)
            asked[key] = (_answer(r["tokens"], eos), _path(engine, r["request_id"]))
        (same_a, _), (same_r, same_path) = asked["base_alone"], asked["base_reuse"]
        (pair_a, _), (pair_p, pair_path) = asked["pair_alone"], asked["pair_plan"]
        res = {"row": row.get("_id", i), "context_tokens": len(ctx), "same_path": same_path, "pair_path": pair_path,
               "first_token_equal": same_a[:1] == same_r[:1],
               "greedy_agreement": measures.greedy_agreement(same_a, same_r),
               "pair_first_token_equal": pair_a[:1] == pair_p[:1],
               "quality_alone": measures.score(spec.metric, decode_answer(tokenizer, pair_a, spec), row["answers"]),
               "quality_plan": measures.score(spec.metric, decode_answer(tokenizer, pair_p, spec), row["answers"])}
        say(f"row {i + 1}/{len(rows)}: {res['context_tokens']} tokens, same model {same_path} "
            f"first token {'=' if res['first_token_equal'] else '!='}, pair {pair_path} "
            f"{spec.metric} {res['quality_alone']:.2f} -> {res['quality_plan']:.2f}")
        out.append(res)
    return out


def ours(tier: Path, rows: Sequence[dict[str, Any]], spec: TaskSpec, plan: ReusePlan, dtype: str) -> dict[str, list[float]]:
    """DroidMesh's own engine on the same rows: the receiver's full prefill and `plan`, per row."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tasks.scorer import PairScorer

    sender = load_model(tier / "base", device="cpu", dtype=dtype, name="base")
    receiver = load_model(tier / "docqa", device="cpu", dtype=dtype, name="docqa")
    scorer = PairScorer(sender, receiver, rows, spec)
    return {"full_prefill": scorer.scores(ReusePlan.full_prefill()), "plan": scorer.scores(plan)}


def summarize(asked: list[dict[str, Any]], engine_scores: dict[str, list[float]] | None) -> dict[str, Any]:
    """The verdicts: agreement rates with Wilson intervals, quality differences with bootstrap ones."""
    n = len(asked)
    first = sum(r["first_token_equal"] for r in asked)
    out: dict[str, Any] = {
        "rows": n,
        "same_model": {"paths": dict(collections.Counter(r["same_path"] for r in asked)),
                       "first_token_equal": first / n, "first_token_interval": intervals.wilson(first, n),
                       "greedy_agreement": statistics.fmean(r["greedy_agreement"] for r in asked)},
    }
    vllm_pair = intervals.paired([r["quality_alone"] for r in asked], [r["quality_plan"] for r in asked])
    pair_first = sum(r["pair_first_token_equal"] for r in asked)
    out["pair"] = {"paths": dict(collections.Counter(r["pair_path"] for r in asked)),
                   "vllm": _verdict(vllm_pair), "first_token_equal": pair_first / n,
                   "first_token_interval": intervals.wilson(pair_first, n)}
    if engine_scores is not None:
        out["pair"]["droidmesh_engine"] = _verdict(intervals.paired(engine_scores["full_prefill"], engine_scores["plan"]))
    return out


def _verdict(p: intervals.Paired) -> dict[str, Any]:
    return {"full_prefill": round(p.reference_mean, 4), "plan": round(p.other_mean, 4),
            "relative": None if p.rel is None else round(p.rel, 4),
            "relative_interval": None if p.rel_lo is None else [round(p.rel_lo, 4), round(p.rel_hi or 0.0, 4)],
            "verdict": p.verdict()}


def run(python: str, tier: Path, n_rows: int, work: Path, say: Callable[[str], None], dtype: str = "float32",
        engine_too: bool = True) -> dict[str, Any]:
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    spec = task_spec(TASK)
    rows = make_rows(TASK, "test", n_rows, SuiteShape())
    base, docqa = ModelRef(tier / "base", "base"), ModelRef(tier / "docqa", "docqa")
    tok = load_model(base.path, device="cpu", dtype="float32").tokenizer
    longest = max(len(encode_row(tok, r, spec)[0]) + len(encode_row(tok, r, spec)[1]) for r in rows)
    env = {**THREADS, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
    with pair_mesh(tier, base, docqa, work, dtype, [r["context"] for r in rows], lora=True) as connector:
        spec_engine = {"model": str(base.path), "name": "base", "loras": {"docqa": str(docqa.path)}, "dtype": dtype,
                       "max_model_len": longest + spec.max_new_tokens + 16, "connector": connector}
        engine = ServedEngine(python, spec_engine, work, free_port(), env)
        try:
            engine.ready(READY_S)
            asked = ask_rows(engine, tok, rows, spec, say=say)
        finally:
            engine.stop()
    scores = ours(tier, rows, spec, PLAN, dtype) if engine_too else None
    return {"task": TASK, "split": "test", "plan": PLAN.label(), "dtype": dtype, "metric": spec.metric,
            "summary": summarize(asked, scores), "per_row": asked,
            "droidmesh_engine_per_row": scores}
