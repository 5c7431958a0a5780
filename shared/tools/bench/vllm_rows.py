"""`droidmesh bench vllm-rows`: vLLM with the DroidMesh connector against vLLM alone, answer by
answer, on the real tier's doc_qa rows (cut from the standard library's docs: its test split, or
`heldout`, the library's packages, for a verdict that needs more rows and sources).

One local mesh (`vllm_reuse.pair_mesh`: a DroidMesh sender of `real/base` holding every row's
context, the pair's plan on the config board) and `vllm serve` with the connector, of `real/base`
and then of `docqa` (merged into its base). Per row, greedy answers of the task's length:
  - same model: `base` asks, vLLM's own full prefill against full reuse of the sender's cache of
    the same weights (mode `full_reuse`): is the first token the same, and what share of the
    answer's tokens agree; and, as the yardstick, vLLM against itself: the same full prefill
    asked again four requests at a time (batched) against alone;
  - the pair: `docqa` asks, vLLM's own full prefill against the pair's plan (`partial`: one
    group of layers recomputed from the sender's E, [6, 9) unless `plan` names another), both
    scored by the task metric; DroidMesh's own engine scores the same plan and its own full
    prefill on the same rows, beside them.
With `same=False` only the pair is asked (the verdict that needs many rows). Verdicts carry
intervals (`tasks/intervals.py`): agreement rates a Wilson interval, quality the
paired difference to full prefill with a bootstrap interval (by document: rows asking about one
context are resampled together; and by source file, a module's rows together) and the 5 % rule
applied to it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from droidmesh.shared.engines.vllm.client import Engine, ServedEngine
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model import text
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import free_port
from droidmesh.shared.service.localmesh import THREADS
from droidmesh.shared.tasks import intervals, measures
from droidmesh.shared.tasks.rows import decode_answer, document_id, encode_row
from droidmesh.shared.tasks.spec import TaskSpec, task_spec
from droidmesh.shared.tools.bench.harness import held_bytes_per_token
from droidmesh.shared.tools.bench.vllm_reuse import PLAN, READY_S, base_tokenizer, merged, pair_mesh

TASK = "doc_qa"


def _answer(tokens: list[int], eos: int | None) -> list[int]:
    """A greedy answer as the engine's own decoding ends it: at the first EOS, kept (the server
    is asked to ignore EOS, so every request generates the same number of tokens)."""
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def document(row: dict[str, Any]) -> str:
    """The id of a row's context (`rows.document_id`)."""
    return document_id(row["context"])


def _path(engine: Engine, request_id: str) -> str:
    if engine.events("reuse_fallback", request_id):
        return "fallback"
    decided = engine.events("request", request_id)
    return ",".join(e["path"] + (f" ({e['reason']})" if e.get("reason") else "") for e in decided) or "none"


def _ask(engine: Engine, key: str, prompt: list[int], spec: TaskSpec, eos: int | None, **kw: Any
         ) -> tuple[list[int], str]:
    r = engine.ask(key, prompt, max_tokens=spec.max_new_tokens, **kw)
    return _answer(r["tokens"], eos), _path(engine, r["request_id"])


def ask_same_model(engine: Engine, tokenizer: Any, rows: Sequence[dict[str, Any]], spec: TaskSpec, *,
                   say: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Per row (its context held by a sender of the engine's base model, same weights): vLLM's
    full prefill against full reuse of the sender's cache: the reuse's path, whether the first
    token is the same, the share of answer tokens that agree."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for i, row in enumerate(rows):
        ctx, q, _ = encode_row(tokenizer, row, spec)
        alone, _ = _ask(engine, f"row{i}-base-alone", ctx + q, spec, eos, mode="full_prefill")
        reused, path = _ask(engine, f"row{i}-base-reuse", ctx + q, spec, eos, mode="full_reuse")
        out.append({"row": row.get("_id", i), "document": document(row), "context_tokens": len(ctx), "same_path": path,
                    "first_token_equal": alone[:1] == reused[:1],
                    "greedy_agreement": measures.greedy_agreement(alone, reused), "answer_alone": alone})
        say(f"same model, row {i + 1}/{len(rows)}: {len(ctx)} tokens, {path}, first token "
            f"{'=' if alone[:1] == reused[:1] else '!='}")
    return out


def ask_batched(engine: Engine, tokenizer: Any, rows: Sequence[dict[str, Any]], spec: TaskSpec,
                same: list[dict[str, Any]], batch: int = 4, *, say: Callable[[str], None] = lambda line: None) -> None:
    """vLLM against itself across batch sizes, the yardstick for full reuse's agreement: each row's
    full prefill asked again with `batch` requests in flight at once (the engine batches them),
    compared with its answer asked alone (`same`'s rows, from `ask_same_model`, updated in place)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    prompts = [sum(encode_row(tokenizer, row, spec)[:2], []) for row in rows]
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        for start in range(0, len(rows), batch):
            idx = range(start, min(len(rows), start + batch))
            asked = {i: pool.submit(_ask, engine, f"row{i}-base-batched", prompts[i], spec, eos, mode="full_prefill")
                     for i in idx}
            for i, future in asked.items():
                answer, _ = future.result()
                same[i]["batched_first_token_equal"] = answer[:1] == same[i]["answer_alone"][:1]
                same[i]["batched_greedy_agreement"] = measures.greedy_agreement(same[i]["answer_alone"], answer)
            say(f"same model, {batch} at once: rows {start + 1}-{idx[-1] + 1}/{len(rows)}")


def ask_pair(engine: Engine, tokenizer: Any, rows: Sequence[dict[str, Any]], spec: TaskSpec, *,
             lora: str | None = None, say: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Per row (its context held by a sender of the pair's sender model): the receiver (`lora`,
    or the engine's base model) with vLLM's full prefill against the pair's plan: the plan's path,
    the task score of each answer, whether their first tokens are the same."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for i, row in enumerate(rows):
        ctx, q, _ = encode_row(tokenizer, row, spec)
        alone, _ = _ask(engine, f"row{i}-pair-alone", ctx + q, spec, eos, lora=lora, mode="full_prefill")
        planned, path = _ask(engine, f"row{i}-pair-plan", ctx + q, spec, eos, lora=lora, mode="auto")
        res = {"row": row.get("_id", i), "document": document(row), "source": row.get("source_file"),
               "context_tokens": len(ctx), "pair_path": path,
               "pair_first_token_equal": alone[:1] == planned[:1],
               "quality_alone": measures.score(spec.metric, decode_answer(tokenizer, alone, spec), row["answers"]),
               "quality_plan": measures.score(spec.metric, decode_answer(tokenizer, planned, spec), row["answers"])}
        # No score in the line: a verdict is read once, on every row asked, never off a running tally.
        say(f"pair, row {i + 1}/{len(rows)}: {len(ctx)} tokens, {path}")
        out.append(res)
    return out


def ours(tier: Path, rows: Sequence[dict[str, Any]], spec: TaskSpec, plan: ReusePlan, dtype: str,
         chunk: int = 16) -> dict[str, list[float]]:
    """DroidMesh's own engine on the same rows: the receiver's full prefill and `plan`, per row.
    A scorer keeps every row's capture (all layers' K/V and E) to score plans over them, so rows
    go `chunk` at a time: 200 rows of the real tier at once would hold ~24 GB."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.tasks.scorer import PairScorer

    sender = load_model(tier / "base", device="cpu", dtype=dtype, name="base")
    receiver = load_model(tier / "docqa", device="cpu", dtype=dtype, name="docqa")
    out: dict[str, list[float]] = {"full_prefill": [], "plan": []}
    for start in range(0, len(rows), chunk):
        scorer = PairScorer(sender, receiver, rows[start:start + chunk], spec)
        out["full_prefill"] += scorer.scores(ReusePlan.full_prefill())
        out["plan"] += scorer.scores(plan)
    return out


def summarize(same: list[dict[str, Any]], pair: list[dict[str, Any]],
              engine_scores: dict[str, list[float]] | None) -> dict[str, Any]:
    """The verdicts: agreement rates with Wilson intervals, quality differences with bootstrap ones."""
    n, m = len(same), len(pair)
    docs = [r["document"] for r in pair]  # a document's rows are resampled together
    sources = [r.get("source") for r in pair]
    pair_first = sum(r["pair_first_token_equal"] for r in pair)
    batched = [r for r in same if "batched_first_token_equal" in r]
    alone, planned = [r["quality_alone"] for r in pair], [r["quality_plan"] for r in pair]
    out: dict[str, Any] = {
        "rows": {"same_model": n, "pair": m},
        "pair": {"paths": dict(collections.Counter(r["pair_path"] for r in pair)), "documents": len(set(docs)),
                 "vllm": _verdict(intervals.paired(alone, planned, groups=docs)),
                 "first_token_equal": pair_first / m, "first_token_interval": intervals.wilson(pair_first, m)},
    }
    if all(sources):
        out["pair"]["sources"] = len(set(sources))
        out["pair"]["vllm_by_source"] = _verdict(intervals.paired(alone, planned, groups=sources))
    if same:
        first = sum(r["first_token_equal"] for r in same)
        out["same_model"] = {"paths": dict(collections.Counter(r["same_path"] for r in same)),
                             "first_token_equal": first / n, "first_token_interval": intervals.wilson(first, n),
                             "greedy_agreement": statistics.fmean(r["greedy_agreement"] for r in same)}
    if batched:  # vLLM against itself, alone and batched: what full reuse's agreement is measured against
        k = sum(r["batched_first_token_equal"] for r in batched)
        out["same_model"]["vllm_across_batch_sizes"] = {
            "rows": len(batched), "first_token_equal": k / len(batched), "first_token_interval": intervals.wilson(k, len(batched)),
            "greedy_agreement": statistics.fmean(r["batched_greedy_agreement"] for r in batched)}
    if engine_scores is not None:
        ours_fp, ours_plan = engine_scores["full_prefill"], engine_scores["plan"]
        out["pair"]["droidmesh_engine"] = _verdict(intervals.paired(ours_fp, ours_plan, groups=docs))
        if all(sources):
            out["pair"]["droidmesh_engine_by_source"] = _verdict(intervals.paired(ours_fp, ours_plan, groups=sources))
    return out


def check_beside(ev: Any, split: str, dtype: str, plan: ReusePlan = PLAN) -> str:
    """The plan's path name in `ev`, an eval `engine_beside` can join (its figures checked as
    `eval-merge` checks a shard; dtype None is the eval's default, float32 on a CPU)."""
    from droidmesh.shared.tasks.evaluation import check_part

    try:
        check_part(ev)
    except ValueError as e:
        raise ConfigError(f"--beside: {e}") from None
    (start, end), = plan.groups
    name = f"group/{start}/{end}"
    want = {"task": TASK, "split": split, "sender": "real/base", "receiver": "real/docqa"}
    wrong = [k for k, v in want.items() if ev.get(k) != v] + (["dtype"] if ev.get("dtype") not in (None, dtype) else [])
    if wrong or name not in ev["per_row"]["paths"]:
        raise ConfigError(f"--beside: not an eval of real/base -> real/docqa on {TASK} {split} ({dtype}) scoring {name}"
                          f" (it differs in {wrong or ['its paths']})")
    return name


def engine_beside(pair: Sequence[dict[str, Any]], ev: dict[str, Any], split: str, dtype: str,
                  plan: ReusePlan = PLAN) -> dict[str, Any]:
    """DroidMesh's engine beside vLLM on the rows both scored: `ev` is a `droidmesh eval` of the
    same pair, task and split with `--per-row` (or shards merged) that scored the plan's group;
    rows are joined by id. Per engine, its plan against its own full prefill (by document), and
    how many rows give the same score in both engines, for full prefill and for the plan.
    Raises ConfigError, one line, for an eval of anything else (`check_beside`)."""
    name = check_beside(ev, split, dtype, plan)
    at = {rid: j for j, rid in enumerate(ev["per_row"]["ids"])}
    both = [(r, at[r["row"]]) for r in pair if r["row"] in at]
    if not both:
        raise ConfigError("--beside: the eval scored none of this run's rows")
    paths = ev["per_row"]["paths"]
    fp = [paths["receiver_full_prefill"]["quality"][j] for _, j in both]
    ours_plan = [paths[name]["quality"][j] for _, j in both]
    docs = [r["document"] for r, _ in both]
    alone, planned = [r["quality_alone"] for r, _ in both], [r["quality_plan"] for r, _ in both]
    return {"rows": len(both), "documents": len(set(docs)), "eval_dtype": ev.get("dtype") or "the eval's default",
            "droidmesh_engine": _verdict(intervals.paired(fp, ours_plan, groups=docs)),
            "vllm": _verdict(intervals.paired(alone, planned, groups=docs)),
            "same_score_full_prefill": sum(abs(a - b) < 1e-9 for a, b in zip(fp, alone, strict=True)),
            "same_score_plan": sum(abs(a - b) < 1e-9 for a, b in zip(ours_plan, planned, strict=True))}


def _verdict(p: intervals.Paired) -> dict[str, Any]:
    return {"full_prefill": round(p.reference_mean, 4), "plan": round(p.other_mean, 4),
            "relative": None if p.rel is None else round(p.rel, 4),
            "relative_interval": None if p.rel_lo is None else [round(p.rel_lo, 4), round(p.rel_hi or 0.0, 4)],
            "verdict": p.verdict()}


FLAGS = {"split": "--split", "dtype": "--dtype", "rows_requested": "--rows", "plan": "--plan"}  # what a user resumes with
FIGURES = {"pair": {"pair_first_token_equal": bool, "quality_alone": float, "quality_plan": float, "pair_path": str},
           "same model": {"first_token_equal": bool, "greedy_agreement": float, "same_path": str}}


def resumed(done: dict[str, Any], rows: Sequence[dict[str, Any]], split: str, dtype: str,
            same: bool, plan: ReusePlan = PLAN) -> dict[str, list[dict[str, Any]]]:
    """The rows a partial run (`done`, its JSON: the user's file) already asked, checked against
    this run's: the same task, split, plan, dtype and row count, the same questions (pair-only or
    not), and each asked row the row at its place in `rows` with its figures (rows are
    prefix-stable: the first k of n are the first k of any longer run), so continuing it scores
    exactly the rows an unbroken run would have. Raises ConfigError, one line, naming the first mismatch."""
    want = {"task": TASK, "split": split, "plan": plan.label(), "dtype": dtype, "rows_requested": len(rows)}
    for key, value in want.items():
        got = done.get(key, value if key == "rows_requested" else None)  # files before the count was kept lack it
        if got != value:
            flag = FLAGS.get(key)
            if key == "plan" and isinstance(got, str) and (m := re.search(r"\[(\d+),\s*(\d+)\)", got)):
                got = f"{m[1]}:{m[2]}"  # a label, "recompute [6,9)", as the flag takes it
            raise ConfigError(f"cannot resume: the partial run was run with {flag} {got}; resume it with {flag} {got}"
                              if flag and got is not None else
                              f"cannot resume: the partial run's {key} is {got!r}, this run's {value!r}")
    pair, asked_same = done.get("pair_per_row"), done.get("same_model_per_row")
    if not isinstance(pair, list) or not isinstance(asked_same, list) or len(pair) > len(rows):
        raise ConfigError(f"cannot resume: the partial run's rows are not a list of at most {len(rows)}")
    if len(asked_same) != (len(pair) if same else 0):
        why = ("was run with --pair-only" if same and not asked_same else "was run without --pair-only" if not same
               else "holds unequal numbers of same-model and pair rows")
        raise ConfigError(f"cannot resume: the partial run {why}")
    for name, records in (("pair", pair), ("same model", asked_same)):
        for i, r in enumerate(records):
            if not isinstance(r, dict) or r.get("row") != rows[i].get("_id") or r.get("document") != document(rows[i]):
                raise ConfigError(f"cannot resume: the partial run's {name} row {i + 1} is not this run's row {i + 1}")
            if not all(_is(r.get(k), t) for k, t in FIGURES[name].items()):
                raise ConfigError(f"cannot resume: the partial run's {name} row {i + 1} lacks its figures")
    return {"same": list(asked_same), "pair": list(pair)}


def _is(v: Any, kind: type) -> bool:
    """A figure of `kind` as this bench writes it: a bool, a share in [0, 1], or a path name."""
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0
    return isinstance(v, kind)


def run(python: str, tier: Path, n_rows: int, work: Path, say: Callable[[str], None], dtype: str = "float32",
        engine_too: bool = True, chunk: int = 150,
        on_chunk: Callable[[dict[str, Any]], None] = lambda partial: None, split: str = "test",
        same: bool = True, done: dict[str, Any] | None = None, plan: ReusePlan = PLAN) -> dict[str, Any]:
    """Two `vllm serve` engines one after the other, each with the connector: `real/base` (the
    same-model questions; not with `same=False`) and `docqa` merged into its base (the pair's: vLLM's CPU LoRA kernels
    prefill many times slower than its dense ones, and the question is the answers, not LoRA).
    Rows go `chunk` at a time, each chunk with a mesh of its own whose sender holds only that
    chunk's contexts (600 rows' contexts at once would be ~16 GB in float32); `on_chunk` gets the
    result so far after each chunk, so a long run killed midway keeps what it measured, and `done`
    (that result, read back) continues it from its first row not asked (`resumed`). `plan` is the
    pair's: published to the mesh, its group start's E held, its label in the JSON."""
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    spec = task_spec(TASK)
    rows = make_rows(TASK, split, n_rows, SuiteShape())
    asked = resumed(done, rows, split, dtype, same, plan) if done else {"same": [], "pair": []}  # before anything slow
    base = ModelRef(tier / "base", "base")
    tok = base_tokenizer(base, plan)  # the plan checked before the merge and the meshes
    docqa = ModelRef(merged(tier / "docqa", work / "docqa-merged"), "docqa")
    longest = max(sum(len(x) for x in encode_row(tok, r, spec)[:2]) for r in rows)
    env = {**THREADS, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
    engine_spec = {"dtype": dtype, "max_model_len": longest + spec.max_new_tokens + 16}
    if asked["pair"]:
        say(f"resuming: rows 1-{len(asked['pair'])} of {len(rows)} already asked")
    for start in range(len(asked["pair"]), len(rows), chunk):
        part = rows[start:start + chunk]
        say(f"rows {start + 1}-{start + len(part)} of {len(rows)}")
        for name, got in _ask_chunk(python, tier, base, docqa, part, tok, spec, dtype, engine_spec, env, work,
                                    say, same, plan).items():
            asked[name] += got
        # The rows so far and no summary: a verdict is read once, on every row, never off a chunk.
        on_chunk(_result(rows[:start + len(part)], asked, None, dtype, spec, split, len(rows), plan, summary=False))
    scores = ours(tier, rows, spec, plan, dtype) if engine_too else None
    return _result(rows, asked, scores, dtype, spec, split, len(rows), plan)


def _ask_chunk(python: str, tier: Path, base: ModelRef, docqa: ModelRef, rows: Sequence[dict[str, Any]], tok: Any,
               spec: TaskSpec, dtype: str, engine_spec: dict[str, Any], env: dict[str, str], work: Path,
               say: Callable[[str], None], same: bool = True, plan: ReusePlan = PLAN) -> dict[str, list[dict[str, Any]]]:
    """One mesh holding `rows`' contexts, and each engine asked every row in turn (`same=False`:
    only the pair's)."""
    contexts = list(dict.fromkeys(r["context"] for r in rows))
    held = sum(len(text.context_ids(tok, c)) for c in contexts)
    store = max(2 << 30, int(1.25 * held * held_bytes_per_token(base.path, dtype, len(plan.e_layers))))  # every context at once
    asked: dict[str, list[dict[str, Any]]] = {}
    with pair_mesh(tier, base, docqa, work, dtype, contexts, lora=False, store_bytes=store, plan=plan) as conn:
        for name, model, base_model in (("same", base, "base"), ("pair", docqa, "docqa"))[0 if same else 1:]:
            engine = ServedEngine(python, {**engine_spec, "model": str(model.path), "name": base_model,
                                           "connector": {**conn, "base_model": base_model}}, work, free_port(), env)
            try:
                engine.ready(READY_S)
                asked[name] = (ask_same_model(engine, tok, rows, spec, say=say) if name == "same"
                               else ask_pair(engine, tok, rows, spec, say=say))
                if name == "same":
                    ask_batched(engine, tok, rows, spec, asked[name], say=say)
            finally:
                engine.stop()
    return asked


def _result(rows: Sequence[dict[str, Any]], asked: dict[str, list[dict[str, Any]]],
            scores: dict[str, list[float]] | None, dtype: str, spec: TaskSpec, split: str, n: int,
            plan: ReusePlan = PLAN, summary: bool = True) -> dict[str, Any]:
    """The run's JSON over `rows` (the first of the `n` it asks for); with `summary`, its verdicts."""
    out = {"task": TASK, "split": split, "plan": plan.label(), "dtype": dtype, "metric": spec.metric, "rows_requested": n,
           "contexts": len({r["context"] for r in rows}),
           "same_model_per_row": list(asked["same"]), "pair_per_row": list(asked["pair"]),  # a snapshot: `asked` grows
           "droidmesh_engine_per_row": scores}
    return {**out, "summary": summarize(asked["same"], asked["pair"], scores)} if summary else out
