"""How long a decoding stream stalls while another request's context loads from the mesh, with the
connector's loads inside the step (`sync`) or beside it (`async`, the `async_load` setting).

The mesh of `bench vllm` (`vllm_reuse.pair_mesh`: a real nats-server, a broker and a DroidMesh
sender of `real/base` holding one ~370-token context per round); vLLM (its CPU build,
`infra/vllm/install.sh`) serving `real/base` with the `docqa` adapter through the connector. Per
round: a `base` request streams 64 tokens (vLLM's own prefill); 1.5 s into it a `docqa` request
over that round's held context is asked (plan [6, 9) from E_6, one answer token). The row: the
stream's longest gap between two tokens while the load request was out, its median gap, the load
request's wall time and the connector's `loaded` ms. With `--no-preload` round 0 also loads
DroidMesh's copy of the weights in the worker (cold); by default the worker loads them at start.

    python infra/vllm/async_load_check.py sync|async [--rounds 4] [--json FILE] [--no-preload]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from droidmesh.shared.engines.vllm.client import PYTHON, ServedEngine
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import free_port
from droidmesh.shared.service.localmesh import THREADS
from droidmesh.shared.tools.bench import vllm_reuse

TIER = Path.home() / ".cache/droidmesh/zoo/real"
CONTEXT = ("The Python Software Foundation is the organization behind Python. It holds the intellectual "
           "property rights behind Python, runs the Python Package Index and organizes PyCon US. ") * 12
QUESTION = "\nQuestion: Which index does the foundation run?\nAnswer:"
STREAM_TOKENS = 64
LOAD_AFTER_S = 1.5


def stream_times(url: str, prompt: list[int]) -> list[float]:
    """The arrival time of each streamed token of a `base` completion vLLM prefills itself."""
    body = {"model": "base", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "vllm_xargs": {"droidmesh_mode": "full_prefill"}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


def round_row(engine: ServedEngine, tok: Any, i: int, async_load: bool) -> dict[str, Any]:
    ctx, q = text.prompt_ids(tok, context(i), QUESTION)
    out: dict[str, list[float]] = {}
    streaming = threading.Thread(target=lambda: out.setdefault(
        "times", stream_times(engine.url, text.prompt_ids(tok, f"Count from {i}:", "")[0])))
    streaming.start()
    time.sleep(LOAD_AFTER_S)
    b0 = time.perf_counter()
    got = engine.ask(f"load{i}", ctx + q, max_tokens=1, lora="docqa")
    b1 = time.perf_counter()
    streaming.join()
    ts = out["times"]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    during = [g for a, b, g in zip(ts, ts[1:], gaps, strict=False) if b > b0 and a < b1]
    (decided,) = engine.events("request", got["request_id"])
    loaded = engine.events("loaded", got["request_id"])
    return {"round": i, "async_load": async_load, "path": decided["path"], "plan": decided.get("plan"),
            "max_gap_during_load_s": max(during) if during else None, "median_gap_s": statistics.median(gaps),
            "load_request_s": b1 - b0, "loaded_ms": loaded[0]["ms"] if loaded else None, "stream_tokens": len(ts)}


def context(i: int) -> str:
    return CONTEXT + f" Note {i}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("mode", choices=["sync", "async"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-preload", action="store_true", help="load DroidMesh's weights at the first reuse (round 0)")
    args = ap.parse_args()
    async_load = args.mode == "async"
    base, docqa = ModelRef(TIER / "base", "base"), ModelRef(TIER / "docqa", "docqa")
    work = Path(f"/tmp/dm-async-load-{args.mode}")
    work.mkdir(exist_ok=True)
    contexts = [context(i) for i in range(args.rounds)]
    with vllm_reuse.pair_mesh(TIER, base, docqa, work, "float32", contexts, lora=True) as connector:
        time.sleep(2.0)  # the broker indexes the last one
        engine = ServedEngine(PYTHON, {"model": str(base.path), "name": "base", "dtype": "float32",
                                       "loras": {"docqa": str(docqa.path)},
                                       "connector": {**connector, "async_load": async_load,
                                                     "preload": not args.no_preload}}, work, free_port(),
                              env={**THREADS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"})
        try:
            tok = load_model(docqa.path, device="cpu", dtype="float32", name="docqa").tokenizer
            engine.ready(600)
            rows = []
            for i in range(args.rounds):
                rows.append(round_row(engine, tok, i, async_load))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            engine.stop()
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
