"""The prepared GPU check: `python -m droidmesh.shared.tools.bench.gpu_check` (run by `infra/gpu/check.sh`).

Sequence (one process, one device; `--tiny` runs the same sequence on the CPU at a toy size):
  1. build the shape (`shared/model/shapes.py`; default llama3-8b) directly on the device in
     bfloat16 (float32 on the CPU);
  2. exactness: recompute-all (partial prefill recomputing every layer from the receiver's own
     embedding) and the model's own HF forward, both in the model's dtype, against the float32 HF
     forward of the same weights: the question's logits' largest absolute difference, recompute-all's
     held to MARGIN times the model's own (FLOAT32_TOLERANCE in float32);
  3. per context length and plan (full prefill, full reuse, recompute k = 1, 2, 4 from layer 0):
     `bench ttft`'s measurement (`shared/tools/bench/ttft.py::measure`: the context captured once, one
     warm-up, the median TTFT of `--repeats` runs of `generate` for one new token, the device's
     peak memory per plan on CUDA);
  3b. the plans the host bounds (full reuse, k = 2) again, every short pass (the suffix) replayed
     from captured layer pieces (`graphed`: rows with `graphs` true; the targets read these, their
     `*_eager` twins the others);
  4. CacheBlend at the middle context (`cacheblend_s`);
  5. overlap at the middle context, k = 2 (`overlap`): the reused KV starts in host memory (pinned
     on CUDA), as a pull leaves it, and lands through the data plane's own `Landing` (the copy
     stream, `shared/kv/streams.py`); `serial_s` lands every layer, then runs the engine;
     `pipelined_s` lands layer by layer on a thread while the engine recomputes;
  6. batched decode (`batched_decode`): 32 sequences over 4K-token caches stepped together
     against one alone (4 over the smallest context with `--tiny`), decode tokens/s and whether
     every row chose the solo tokens, three ways: ragged, a decode pool run eagerly, and the
     pool's steps replayed as CUDA graphs (graphs on / off: `graphs_on_vs_off_*` in `targets`);
  7. `targets` from the rows (null where a context was not run or the device keeps no peak) and
     one JSON to `--out`; a table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared import report
from droidmesh.shared.kv import decode
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.decode import Decoding
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.pool import KVPool
from droidmesh.shared.kv.sources import ArrivingSource, CapturedSource
from droidmesh.shared.model import hf_cache, shapes
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.model.graphs import Capture, LayerGraphs, cuda_capture, eager_capture
from droidmesh.shared.model.sampling import greedy
from droidmesh.shared.tools.bench import ttft
from droidmesh.shared.transport import codecs, pull
from droidmesh.shared.transport.bulk import Landing
from droidmesh.shared.wire.hashing import common_prefix
from droidmesh.shared.wire.schemas import TensorHeader

GIB = 1 << 30
QUESTION_TOKENS = ttft.QUESTION_TOKENS
KS = (1, 2, 4)
# Recompute-all must be no further from the float32 forward of the same weights than the model's
# own forward in its dtype is, within MARGIN: the same math in another order rounds differently,
# while a wrong layer, position or cache read moves logits by their own size. In float32 both
# sides are the reference's dtype, so the bound is FLOAT32_TOLERANCE alone.
FLOAT32_TOLERANCE = 1e-3
MARGIN = 2.0
FULL_CONTEXTS = (4096, 8192, 16384, 32768, 65536)
TINY_CONTEXTS = (256, 512)
COLUMNS = ["context", "plan", "graphs", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal", "peak_mem_gib"]


def exactness(model: ModelAdapter, tokens: int, seed: int = 0) -> dict[str, Any]:
    """Recompute-all vs the float32 forward of the same weights over a `tokens`-token context and a
    question, beside the model's own forward in its dtype against that reference."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ctx = torch.randint(0, vocab, (tokens,), generator=g).tolist()
    q = torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
    ids = torch.tensor([ctx + q], device=model.device)  # [1, T + Q]
    with torch.inference_mode():
        own = model.model(input_ids=ids, use_cache=False, logits_to_keep=len(q)).logits[0].float()  # [Q, vocab]
        got = prefill(model, ctx + q, ReusePlan.recompute(0, model.num_layers), CapturedSource(capture_prefill(model, ctx)),
                      logits_for=len(q)).logits.float()
        if model.dtype == torch.float32:
            ref = own
        else:
            wide = copy.deepcopy(model.model).float()
            ref = wide(input_ids=ids, use_cache=False, logits_to_keep=len(q)).logits[0].float()
            del wide
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
    diff, own_diff = float((got - ref).abs().max()), float((own - ref).abs().max())
    bound = max(FLOAT32_TOLERANCE, MARGIN * own_diff)
    return {"tokens": tokens, "reference": "float32 forward of the same weights", "max_abs_diff": diff,
            "model_forward_max_abs_diff": own_diff, "tolerance": bound, "ok": diff <= bound}


def measure(model: ModelAdapter, contexts: list[int], repeats: int, seed: int = 0) -> tuple[list[dict[str, Any]], float | None]:
    """Rows per (context, plan) (`bench ttft`'s measurement, in this check's keys) and
    CacheBlend's TTFT at the middle context."""
    rows = [{"context": r["context_tokens"], "plan": r["plan"], "recomputed_layers": r["recomputed_layers"],
             "total_layers": r["total_layers"], "ttft_s": r["ttft_s"], "speedup": r["speedup"],
             "ideal": r["ideal_speedup"], "peak_mem_gib": r["peak_mem_gib"]}
            for r in ttft.measure(model, contexts, repeats, seed, ks=KS)]
    g = torch.Generator().manual_seed(seed + 1)
    n, vocab = contexts[len(contexts) // 2], model.config.vocab_size
    ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
    prompt = ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
    source = CapturedSource(capture_prefill(model, ctx))
    blend = [generate(model, prompt, ReusePlan.cacheblend(0.15), source, max_new_tokens=1).ttft_s
             for _ in range(repeats + 1)][1:]
    return rows, statistics.median(blend)


GRAPHED_PLANS = (ReusePlan.full_reuse(), ReusePlan.recompute(0, 2))


def graphed(model: ModelAdapter, contexts: list[int], repeats: int, eager: list[dict[str, Any]], capture: Capture,
            seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The plans the host bounds (`GRAPHED_PLANS`) again, with the model's short passes replayed
    from captured layer pieces (`graphs.LayerGraphs`, warmed first): rows in `measure`'s keys plus
    `graphs`, the speedup against the eager rows' full prefill; and the number of graphs."""
    model.graphs = LayerGraphs(model, capture)
    count = model.graphs.warm()
    g = torch.Generator().manual_seed(seed + 7)
    vocab, L = model.config.vocab_size, model.num_layers
    full = {r["context"]: r["ttft_s"] for r in eager if r["plan"] == ReusePlan.full_prefill().label()}
    rows = []
    try:
        for n in contexts:
            ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
            prompt = ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
            source = CapturedSource(capture_prefill(model, ctx))
            for plan in GRAPHED_PLANS:
                s = statistics.median([generate(model, prompt, plan, source, max_new_tokens=1).ttft_s
                                       for _ in range(repeats + 1)][1:])
                k = len(plan.recomputed_layers(L))
                rows.append({"context": n, "plan": plan.label(), "recomputed_layers": k, "total_layers": L,
                             "ttft_s": s, "speedup": full[n] / s if n in full else None,
                             "ideal": L / k if k else None, "peak_mem_gib": None, "graphs": True})
    finally:
        model.graphs = None
    return rows, count


def overlap(model: ModelAdapter, n: int, repeats: int, k: int = 2, seed: int = 2) -> dict[str, Any]:
    """TTFT of recomputing layers [0, k) at `n` tokens with the reused KV landing from host memory:
    serial (land all, then compute) and pipelined (land on a thread while the engine runs)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
    prompt = ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
    captured = capture_prefill(model, ctx)
    plan = ReusePlan.recompute(0, k)
    items = pull.pull_items(plan, model.num_layers)
    pinned = model.device.type == "cuda"
    host = [codecs.payload_view(captured.kv[it.layer].k if it.kind == "K" else captured.kv[it.layer].v).cpu()
            for it in items]  # uint8 [nbytes] per item, where a channel leaves it
    if pinned:
        host = [h.pin_memory() for h in host]
    del captured

    def land_all(source: ArrivingSource) -> None:
        try:
            for it, out, recv in zip(items, pull.buffers(model, n, items), host, strict=True):
                header = TensorHeader(context_id="overlap", layer=it.layer, kind=it.kind, shape=list(out.shape),
                                      dtype=dtype_name(out.dtype), codec="raw", codec_params={}, nbytes=recv.numel(),
                                      checksum="")
                source.put(it.kind, it.layer,
                           Landing(it, header, codecs.get("raw"), out, "pinned" if pinned else "host", recv).land(verify=False))
        except BaseException as e:  # the engine's read raises with this cause, not after its timeout
            source.fail(e)
            raise

    answers: set[int] = set()

    def once(pipelined: bool) -> float:
        source = ArrivingSource(tuple(ctx), model.fingerprint)
        start = time.perf_counter()
        lander = threading.Thread(target=land_all, args=(source,))
        lander.start()
        if not pipelined:
            lander.join()
        answers.add(generate(model, prompt, plan, source, max_new_tokens=1).tokens[0])
        took = time.perf_counter() - start
        lander.join()
        return took

    runs = {mode: statistics.median([once(mode == "pipelined") for _ in range(repeats + 1)][1:])
            for mode in ("serial", "pipelined")}
    return {"context": n, "plan": plan.label(), "host_kv_gib": sum(h.numel() for h in host) / GIB,
            "pinned": pinned, "serial_s": runs["serial"], "pipelined_s": runs["pipelined"],
            "pipelined_vs_serial": runs["serial"] / runs["pipelined"], "same_answer": len(answers) == 1}


DECODE_WAYS = ("ragged", "pool", "graphs")


def batched_decode(model: ModelAdapter, n: int, batch: int, steps: int = 16, seed: int = 3) -> list[dict[str, Any]]:
    """Decode tokens/s of `batch` sequences stepped together (`decode.step`, continuous batching's
    step) against one sequence alone, each over its own copy of one n-token prompt's cache; and
    whether every row chose the solo ragged sequence's tokens (greedy), else the first token where
    one parted from them (a batch runs its products at other shapes than one row, which may round
    differently: in bfloat16 a near-tie can flip a late token, while a wrong row parts at once).
    One row per way of stepping (`DECODE_WAYS`): each row's own cache (ragged); a decode pool run
    eagerly (pool); the pool's steps captured per bucket and replayed (graphs: CUDA graphs on a
    CUDA device, the eager stand-in `pool.eager_capture` on the CPU, which shows the sequence, not
    the gain)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    pre = prefill(model, ids, ReusePlan.full_prefill(), decode_tokens=steps + 1)

    def rows(count: int, sampler: Any = greedy) -> list[Decoding]:
        out = []
        for _ in range(count):
            d = Decoding(hf_cache.fork(pre.cache, model.config, n + steps + 1), n, steps + 1, None, sampler)
            d.take(pre.logits[-1])
            out.append(d)
        return out

    def timed(ds: list[Decoding], way: str) -> float:
        capture = (cuda_capture() if model.device.type == "cuda" else eager_capture) if way == "graphs" else None
        kv = KVPool(model, len(ds), n + steps + 2, capture) if way != "ragged" else None
        decode.step(model, ds, kv)  # warm-up (allocations, kernels; the bucket's capture)
        _sync(model)
        t0 = time.perf_counter()
        while not all(d.done for d in ds):
            decode.step(model, ds, kv)
        _sync(model)
        return time.perf_counter() - t0

    made = steps - 1  # tokens each row decoded in the timed steps
    margins: list[float] = []  # per token of the reference: its top-1 over top-2 logit, relative
    reference = rows(1, _recording(margins))
    timed(reference, "ragged")
    tie = TIE_EPS * torch.finfo(model.dtype).eps
    out = []
    for way in DECODE_WAYS:
        solo, together = rows(1), rows(batch)
        try:
            solo_s, batch_s = timed(solo, way), timed(together, way)
        except Exception as e:  # a capture the device refuses: that way's row says why
            print(f"batched decode, {way}: {type(e).__name__}: {e}", file=sys.stderr)
            out.append({"way": way, "context": n, "batch": batch, "error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"way": way, "context": n, "batch": batch, "solo_tokens_per_s": made / solo_s,
                    "batched_tokens_per_s": made * batch / batch_s,
                    "speedup": (made * batch / batch_s) / (made / solo_s),
                    "same_tokens": all(d.tokens == reference[0].tokens for d in solo + together),
                    "first_divergence": _first_divergence(solo + together, reference[0].tokens),
                    **agreement([d.tokens for d in solo + together], reference[0].tokens, margins, tie)})
    return out


# A row that parts from the solo reference where the reference's top two logits were within this
# many units of the dtype's epsilon (relative to the top logit) parted by rounding: a batch sums
# its products in another order, and in bfloat16 every logit carries that much rounding through
# the layers. Where the reference was decided by more, the row's answer changed.
TIE_EPS = 8


def _recording(margins: list[float]) -> Any:
    """Greedy, noting each step's top-1 over top-2 logit margin relative to the top logit."""
    def pick(logits: torch.Tensor) -> int:
        top = logits.detach().float().flatten().topk(2).values
        margins.append(float(top[0] - top[1]) / max(1.0, abs(float(top[0]))))
        return greedy(logits)
    return pick


def agreement(rows: list[list[int]], reference: list[int], margins: list[float], tie: float) -> dict[str, Any]:
    """Each row's greedy tokens against the solo reference's: agreeing throughout, parting at a
    near-tie of the reference (relative margin <= `tie` at that step: rounding), or changed."""
    agree = near = 0
    for tokens in rows:
        if tokens == reference:
            agree += 1
            continue
        at = common_prefix(tokens, reference)
        near += at < len(margins) and margins[at] <= tie
    return {"sequences": len(rows), "rows_agree": agree, "rows_near_tie": near, "rows_changed": len(rows) - agree - near,
            "agree_share": agree / len(rows) if rows else None}


def _first_divergence(rows: list[Decoding], reference: list[int]) -> int | None:
    """The index of the first token where some row's tokens part from `reference` (None: none does)."""
    shared = min(common_prefix(d.tokens, reference) for d in rows)
    return None if all(d.tokens == reference for d in rows) else shared


def _sync(model: ModelAdapter) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def targets(model: ModelAdapter, rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def row(n: int, plan: str) -> dict[str, Any] | None:  # the graphed row where there is one
        found = [r for r in rows if r["context"] == n and r["plan"] == plan]
        return next((r for r in found if r.get("graphs")), found[0] if found else None)

    k2 = row(32768, ReusePlan.recompute(0, 2).label())
    reuse64 = row(65536, ReusePlan.full_reuse().label())
    peaks = [r["peak_mem_gib"] for r in rows if r["context"] == 32768 and r["peak_mem_gib"] is not None]
    return {"k2_32k_fraction_of_ideal": k2["speedup"] / k2["ideal"] if k2 else None,
            "full_reuse_64k_s": reuse64["ttft_s"] if reuse64 else None,
            "peak_mem_32k_gib": max(peaks) if peaks else None,
            "weights_gib": shapes.weights_bytes(model) / GIB, "kv_32k_gib": shapes.kv_bytes(model, 32768) / GIB}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.gpu_check")
    parser.add_argument("--tiny", action="store_true", help="the toy shape on the CPU (what CI runs)")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(shapes.SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default=None, help="comma list of tokens (default: 4K..64K; --tiny: 256,512)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file")
    args = parser.parse_args(argv)
    shape, device = ("tiny", "cpu") if args.tiny else (args.shape, args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU path", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else list(TINY_CONTEXTS if args.tiny else FULL_CONTEXTS)
    model = shapes.build(shape, device)
    exact = exactness(model, min(contexts))
    rows, blend_s = measure(model, contexts, args.repeats)
    eager_rows = [dict(r, graphs=False) for r in rows]
    capture = cuda_capture() if model.device.type == "cuda" else eager_capture
    graph_error: str | None = None
    try:  # a capture the device refuses costs the graph rows, not the check
        graph_rows, graph_count = graphed(model, contexts, args.repeats, eager_rows, capture)
    except Exception as e:
        graph_rows, graph_count, graph_error = [], 0, f"{type(e).__name__}: {e}"
        print(f"layer graphs failed: {graph_error}", file=sys.stderr)
    rows = eager_rows + graph_rows
    overlapped = overlap(model, contexts[len(contexts) // 2], args.repeats)
    batched = batched_decode(model, min(contexts) if args.tiny else 4096, 4 if args.tiny else 32)
    found = targets(model, rows)
    off = targets(model, eager_rows)
    found["k2_32k_fraction_of_ideal_eager"] = off["k2_32k_fraction_of_ideal"]
    found["full_reuse_64k_s_eager"] = off["full_reuse_64k_s"]
    way = {r["way"]: r for r in batched if "error" not in r}
    # targets: >= 10x one sequence (the best way); graphs on / off: the same pool, replayed / eager
    found["batched_decode_32_at_4k_x"] = None if args.tiny or not way else max(r["speedup"] for r in way.values())
    both = "graphs" in way and "pool" in way
    for key, col in (("graphs_on_vs_off_solo_x", "solo_tokens_per_s"), ("graphs_on_vs_off_batched_x", "batched_tokens_per_s")):
        found[key] = way["graphs"][col] / way["pool"][col] if both else None
    out = {"suite": "gpu_check", "machine": report.machine(), "shape": shape, "device": str(model.device),
           "dtype": str(model.dtype).removeprefix("torch."), "rows": rows, "targets": found,
           "exactness": exact, "cacheblend_s": blend_s, "overlap": overlapped, "batched_decode": batched,
           "graphs": {"layer_graphs": graph_count, "error": graph_error,
                      "what": ("CUDA graphs: rows with graphs true replay every short pass (<= 128 tokens: the "
                               "suffix) from captured layer pieces; batched_decode way 'graphs' replays a decode "
                               "pool's step per (batch, keys) bucket" if model.device.type == "cuda" else
                               "cpu: graphs are the eager stand-in (the sequence, not the gain)")}}
    print(report.format_table(rows, COLUMNS))
    print(report.format_table(batched, ["way", "context", "batch", "solo_tokens_per_s", "batched_tokens_per_s",
                                        "speedup", "same_tokens", "first_divergence", "rows_agree",
                                        "rows_near_tie", "rows_changed"]))
    print(json.dumps({"targets": found, "exactness": exact, "cacheblend_s": blend_s, "overlap": overlapped,
                      "batched_decode": batched}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if exact["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
