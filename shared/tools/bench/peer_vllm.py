"""The vLLM side of `droidmesh bench peer`: run under the peer's own Python (its environment has
vLLM and not DroidMesh), as `python peer_vllm.py REQUEST.json RESULT.json`.

Imports only the standard library and vLLM, so it runs beside whatever versions vLLM pins. The
request names the checkpoint, dtype and the token ids to send (the caller tokenized them, so
both engines see the same prompts); the result holds, per context length, the median seconds of
a one-token generation (TTFT as an offline user sees it: scheduling, prefill, the first token),
and for the decode batch the seconds of `new_tokens` and of one token for the same prompts
together, and the tokens chosen (greedy). Prefix caching is off, so a repeated prompt is
prefilled again.

vLLM starts its engine in a spawned process, hence the guard on the entry point.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def _say(what: str) -> None:
    print(f"peer: {what}", flush=True)


def _timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def measure(req: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    longest = max(len(p) for p in [*req["decode_prompts"], *(q for ps in req["ttft_prompts"].values() for q in ps)])
    began = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req["dtype"], enable_prefix_caching=False, seed=0,
              max_model_len=longest + req["new_tokens"] + 8, max_num_seqs=max(len(req["decode_prompts"]), 1))
    load_s = time.perf_counter() - began
    _say(f"vLLM {vllm.__version__} ready after {load_s:.0f} s")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=req["new_tokens"], temperature=0.0, ignore_eos=True)
    _timed(llm, [req["decode_prompts"][0]], one)  # warm-up
    ttft: dict[str, Any] = {}
    for n, prompts in req["ttft_prompts"].items():
        times, first = [], []
        for r in range(req["repeats"] + 1):  # the first of each length is a warm-up
            s, toks = _timed(llm, [prompts[r % len(prompts)]], one)
            if r:
                times.append(s)
            first.append(toks[0][0])
        _say(f"{n} tokens: TTFT {statistics.median(times):.3f} s")
        ttft[n] = {"ttft_s": statistics.median(times), "times_s": times, "first_tokens": first}
    prefill_s: list[float] = []
    decode_s: list[float] = []
    tokens: list[list[int]] = []
    for _ in range(req["repeats"]):
        s1, _toks = _timed(llm, req["decode_prompts"], one)
        sn, tokens = _timed(llm, req["decode_prompts"], many)
        prefill_s.append(s1)
        decode_s.append(sn)
        _say(f"{len(req['decode_prompts'])} together: {s1:.2f} s for one token, {sn:.2f} s for {req['new_tokens']}")
    return {"engine": "vllm", "version": vllm.__version__, "load_s": load_s, "ttft": ttft,
            "decode": {"one_token_s": prefill_s, "all_tokens_s": decode_s, "tokens": tokens}}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        request = json.load(f)
    result = measure(request)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
