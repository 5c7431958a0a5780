"""`droidmesh bench peer`: our engine against the one a user would pick instead (vLLM on this
CPU), on the same checkpoint, prompts, dtype and core, in one run.

The peer runs in its own Python environment (vLLM pins its own torch and transformers):
`peer_vllm.py` is started there as a subprocess with the prompts as token ids, and returns its
timings as JSON. Then our engine runs in this process, pinned to the same core with one torch
thread. The peer goes first and has exited before ours starts, so the two never share the core.

Per context length: TTFT of the peer's full prefill, ours, ours recomputing k layers over a
cached context (the rest reused) and full reuse; the context is held by a capture of this
same model, so these rows measure time, not quality. Decode: `batch` prompts decoding
`new_tokens` greedy tokens together, the peer's seconds for all tokens minus its seconds for
one (both over the same prompts at once), against the sum of our batched decode steps (each
request's own cache, and a decode pool: the faster way is the one compared; both in the JSON). The
peer's prefills of a batch may overlap its first decode steps (chunked prefill), which only
flatters its decode rate.

Prompts: doc_qa test rows (the Python standard library's module docs, `shared/tasks/realtext.py`),
cut to each length in the checkpoint's own tokens, with each row's question appended.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.kv import decode
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, generate_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.pool import KVPool
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.tools.bench.load import concurrency_prompts
from droidmesh.shared.wire.hashing import common_prefix

SCRIPT = Path(__file__).with_name("peer_vllm.py")
Prompt = tuple[list[int], list[int]]  # (context ids, question ids)


class PeerError(DroidMeshError):
    code = "peer_failed"


def make_prompts(tokenizer: Any, contexts: Sequence[int], batch: int, decode_tokens: int
                 ) -> tuple[dict[int, Prompt], list[Prompt]]:
    """One (context, question) per context length, and `batch` distinct ones of `decode_tokens`
    context tokens for the decode rows; contexts are cut to exactly their length in tokens."""
    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(pairs: list[tuple[str, str]], n: int) -> list[Prompt]:
        return [(ids(c)[:n], ids(q)) for c, q in pairs]

    ttft = {n: cut(concurrency_prompts("real", n, 1, tokenizer), n)[0] for n in contexts}
    return ttft, cut(concurrency_prompts("real", decode_tokens, batch, tokenizer), decode_tokens)


def run_vllm(python: str, model_path: str, dtype: str, ttft_prompts: dict[int, Prompt], decode_prompts: list[Prompt],
             new_tokens: int, repeats: int, core: int, timeout_s: float) -> dict[str, Any]:
    """The peer's timings (`peer_vllm.measure`), run by `python` bound to `core`."""
    if not Path(python).is_file():
        raise PeerError(f"no peer python at {python!r}; give the vLLM environment's python with --peer-python")
    request = {"model": model_path, "dtype": dtype, "repeats": repeats, "new_tokens": new_tokens,
               "ttft_prompts": {str(n): [c + q] for n, (c, q) in ttft_prompts.items()},
               "decode_prompts": [c + q for c, q in decode_prompts]}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="droidmesh-peer-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        req_path.write_text(json.dumps(request))
        log_path = Path(tmp, "stderr.txt")
        with log_path.open("w") as err:
            code = _run_echoing([python, str(SCRIPT), str(req_path), str(out_path)], env, err, timeout_s)
        if code is None:
            raise PeerError(f"the peer did not finish within {timeout_s:.0f} s")
        if code != 0 or not out_path.is_file():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise PeerError(f"the peer exited with {code}: {tail[0][:300]}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


def _run_echoing(argv: list[str], env: dict[str, str], err: Any, timeout_s: float) -> int | None:
    """Run `argv`, echoing its stdout (progress lines) to our stderr and writing its stderr to
    `err`; its exit code, or None when it ran past `timeout_s` (then it is killed, with the
    engine processes it started: they share its session, and would otherwise hold the pipe)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line.rstrip(), file=sys.stderr, flush=True)
        code = proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode is not None and proc.returncode < 0
        timer.cancel()
    return None if timed_out else code


def _ttft(model: ModelAdapter, prompt: list[int], plan: ReusePlan, source: CapturedSource | None,
          repeats: int) -> tuple[float, int]:
    """Median TTFT of `repeats` runs after a warm-up, and the first token chosen."""
    runs = [generate(model, prompt, plan, source, max_new_tokens=1) for _ in range(repeats + 1)]
    return statistics.median(r.ttft_s for r in runs[1:]), runs[-1].tokens[0]


def _decode_round(model: ModelAdapter, prompts: list[Prompt], new_tokens: int,
                  pool: KVPool | None = None) -> tuple[float, list[list[int]]]:
    """Each prompt prefilled alone, then all decoded together (in `pool`, when given): the steps'
    seconds and the tokens."""
    rows: list[decode.Decoding] = []
    for c, q in prompts:
        steps = generate_steps(model, c + q, ReusePlan.full_prefill(), None, max_new_tokens=new_tokens)
        for need in steps:  # a full prefill without a source needs nothing until its decode
            if need.kind == "decode":
                rows.extend(need.decodings)
                break
    seconds = 0.0
    while any(not d.done for d in rows):
        seconds += decode.step(model, rows, pool)
    return seconds, [d.tokens for d in rows]


def measure_ours(model: ModelAdapter, ttft_prompts: dict[int, Prompt], decode_prompts: list[Prompt], ks: Sequence[int],
                 new_tokens: int, repeats: int) -> dict[str, Any]:
    L = model.num_layers
    ttft: dict[int, list[dict[str, Any]]] = {}
    for n, (c, q) in tqdm(ttft_prompts.items(), desc="ours ttft", unit="length"):
        source = CapturedSource(capture_prefill(model, c))
        plans = [ReusePlan.full_prefill(), *(ReusePlan.recompute(0, k) for k in ks if 0 < k < L), ReusePlan.full_reuse()]
        ttft[n] = []
        for plan in plans:
            s, first = _ttft(model, c + q, plan, None if plan.mode == "full_prefill" else source, repeats)
            ttft[n].append({"mode": plan.mode if plan.mode != "groups" else "partial",
                            "recomputed_layers": len(plan.recomputed_layers(L)), "ttft_s": s, "first_token": first})
    # decode both ways the receiver offers: each request's own cache (ragged), and a decode pool
    longest = max(len(c) + len(q) for c, q in decode_prompts) + new_tokens + 1
    pool = KVPool(model, len(decode_prompts), longest)
    rates: dict[str, list[float]] = {"ragged": [], "pool": []}
    tokens: list[list[int]] = []
    for way, kv in (("ragged", None), ("pool", pool)):
        _decode_round(model, decode_prompts[:2], 2, kv)  # warm-up
        for _ in tqdm(range(repeats), desc=f"ours decode ({way})", unit="round"):
            seconds, tokens = _decode_round(model, decode_prompts, new_tokens, kv)
            rates[way].append(sum(len(t) - 1 for t in tokens) / seconds)
    best = max(rates, key=lambda w: statistics.median(rates[w]))
    return {"ttft": ttft, "decode_tokens_per_s": statistics.median(rates[best]), "decode_way": best,
            "decode_rates": rates, "tokens": tokens}


def rows(peer: dict[str, Any], ours: dict[str, Any], batch: int, new_tokens: int) -> dict[str, Any]:
    """The side-by-side TTFT table and the decode comparison (`targets` judges them)."""
    table: list[dict[str, Any]] = []
    for n, ours_rows in ours["ttft"].items():
        p = peer["ttft"][str(n)]
        table.append({"context_tokens": n, "engine": "vllm", "mode": "full_prefill", "recomputed_layers": None,
                      "ttft_s": p["ttft_s"], "peer_full_over_this": 1.0, "first_token_as_peer": True})
        for r in ours_rows:
            table.append({"context_tokens": n, "engine": "droidmesh", **{k: r[k] for k in ("mode", "recomputed_layers")},
                          "ttft_s": r["ttft_s"], "peer_full_over_this": p["ttft_s"] / r["ttft_s"],
                          "first_token_as_peer": r["first_token"] == p["first_tokens"][-1]})
    d = peer["decode"]
    peer_decode_s = statistics.median(a - o for a, o in zip(d["all_tokens_s"], d["one_token_s"], strict=True))
    peer_rate = batch * (new_tokens - 1) / peer_decode_s if peer_decode_s > 0 else None
    same = [common_prefix(a, b) / new_tokens for a, b in zip(ours["tokens"], d["tokens"], strict=True)]
    decode_row = {"batch": batch, "new_tokens": new_tokens, "vllm_tokens_per_s": peer_rate,
                  "droidmesh_tokens_per_s": ours["decode_tokens_per_s"], "droidmesh_way": ours.get("decode_way"),
                  "droidmesh_tokens_per_s_by_way": {w: statistics.median(r)
                                                    for w, r in ours.get("decode_rates", {}).items() if r},
                  "droidmesh_over_vllm": ours["decode_tokens_per_s"] / peer_rate if peer_rate else None,
                  "same_tokens_share": statistics.mean(same)}
    return {"ttft": table, "decode": decode_row}


def targets(table: list[dict[str, Any]], decode_row: dict[str, Any], k: int, at: int = 2048) -> dict[str, Any]:
    """The three ratios the comparison is judged by: ours over the peer's full prefill per length
    (<= 1.25), the peer's full prefill over ours recomputing `k` layers at `at` tokens (>= 5),
    our decode rate over the peer's (>= 0.5)."""
    def ttft(n: int, engine: str, mode: str, layers: int | None = None) -> float | None:
        return next((r["ttft_s"] for r in table if (r["context_tokens"], r["engine"], r["mode"]) == (n, engine, mode)
                     and (layers is None or r["recomputed_layers"] == layers)), None)

    lengths = sorted({r["context_tokens"] for r in table})
    full = {n: ttft(n, "droidmesh", "full_prefill") / ttft(n, "vllm", "full_prefill") for n in lengths}  # type: ignore[operator]
    ours_partial, peer_full = ttft(at, "droidmesh", "partial", k), ttft(at, "vllm", "full_prefill")
    partial = peer_full / ours_partial if ours_partial and peer_full else None
    decode_ratio = decode_row["droidmesh_over_vllm"]
    return {"full_prefill_over_vllm": full, "full_prefill_within_1_25": all(v <= 1.25 for v in full.values()),
            f"vllm_full_over_partial_{k}_at_{at}": partial, "partial_at_least_5x": partial is not None and partial >= 5,
            "decode_over_vllm": decode_ratio, "decode_at_least_half": decode_ratio is not None and decode_ratio >= 0.5}


def run(python: str, model: ModelAdapter, model_path: str, tokenizer: Any, contexts: Sequence[int], ks: Sequence[int],
        batch: int, decode_tokens: int, new_tokens: int, repeats: int, core: int, timeout_s: float) -> dict[str, Any]:
    """The whole comparison: prompts, the peer (subprocess), ours (this process, same core)."""
    dtype = str(model.dtype).removeprefix("torch.")
    ttft_prompts, decode_prompts = make_prompts(tokenizer, contexts, batch, decode_tokens)
    load_before = os.getloadavg()
    print(f"peer: vLLM on core {core} (its first start compiles for minutes)", file=sys.stderr)
    began = time.perf_counter()
    peer = run_vllm(python, model_path, dtype, ttft_prompts, decode_prompts, new_tokens, repeats, core, timeout_s)
    peer_s = time.perf_counter() - began
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = measure_ours(model, ttft_prompts, decode_prompts, ks, new_tokens, repeats)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
    out = rows(peer, ours, batch, new_tokens)
    return {**out, "targets": targets(out["ttft"], out["decode"], ks[0]) if ks else {},
            "peer": {k: peer[k] for k in ("engine", "version", "load_s")}, "peer_run_s": peer_s,
            "dtype": dtype, "core": core, "repeats": repeats,
            "prompt_tokens": {n: len(c) + len(q) for n, (c, q) in ttft_prompts.items()},
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "prompts_source": "doc_qa test rows (Python standard library module docs)"}


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT per context length for each engine and mode (log scale), and decode tokens/s."""
    plt = report.pyplot()

    table = result["ttft"]
    series: dict[str, dict[int, float]] = {}
    for r in table:
        label = f"{r['engine']} {r['mode']}" + (f" k={r['recomputed_layers']}" if r["mode"] == "partial" else "")
        series.setdefault(label, {})[r["context_tokens"]] = r["ttft_s"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    lengths = sorted({r["context_tokens"] for r in table})
    width = 0.8 / max(len(series), 1)
    for i, (label, ys) in enumerate(series.items()):
        a.bar([j + i * width for j in range(len(lengths))], [ys.get(n, 0) for n in lengths], width, label=label)
    a.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
    a.set_yscale("log")
    a.set_xlabel("context tokens")
    a.set_ylabel("TTFT (s, one core)")
    a.legend(fontsize=8)
    d = result["decode"]
    b.bar(["vllm", "droidmesh"], [d["vllm_tokens_per_s"] or 0, d["droidmesh_tokens_per_s"]], color=["C0", "C1"])
    b.set_ylabel(f"decode tokens/s ({d['batch']} together)")
    fig.suptitle(f"DroidMesh against {result['peer']['engine']} {result['peer']['version']}, {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
