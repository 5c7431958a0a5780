"""An offline vLLM engine with the DroidMesh connector, driven by JSON lines: run under the vLLM
environment's Python (`infra/vllm/install.sh`), as

    python -m droidmesh.shared.engines.vllm.offline ENGINE.json < requests.jsonl

ENGINE.json: {"model": checkpoint, "dtype": "float32", "max_model_len": 4096, "loras": {name: path},
"connector": the connector's settings (`engines/settings.py`), or null for vLLM alone}. Each
stdin line {"id", "prompt": [token ids], "max_tokens", "lora": name or null, "mode": "auto"}
is answered greedily by one stdout line `RESULT {"id", "request_id", "tokens", "seconds", "decode_s"}`
(seconds: the whole `generate` call; with max_tokens 1, the time to first token as an offline
user sees it; decode_s: from the first token to the last in vLLM's own request stats, null for
one token). `READY` is printed once the engine is up. vLLM spawns its engine processes,
hence the guard on the entry point.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from droidmesh.shared.engines.vllm.client import kv_transfer_config


def engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("connector") is not None:
        kv = KVTransferConfig(**kv_transfer_config(spec["connector"]))
    loras = spec.get("loras") or {}
    extra: dict[str, Any] = {"enable_lora": True, "max_lora_rank": spec.get("max_lora_rank", 16),
                             "max_loras": max(len(loras), 1)} if loras else {}
    return LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=spec.get("max_model_len", 4096),
               enable_prefix_caching=False, enforce_eager=True, seed=0, max_num_seqs=spec.get("max_num_seqs", 4),
               kv_transfer_config=kv, disable_log_stats=False, **extra)  # stats: each request's token times


def answer(llm: Any, loras: dict[str, str], cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    names = sorted(loras)
    lora = cmd.get("lora")
    request = LoRARequest(lora, names.index(lora) + 1, loras[lora]) if lora else None
    params = SamplingParams(max_tokens=int(cmd.get("max_tokens", 16)), temperature=0.0, ignore_eos=True,
                            extra_args={"droidmesh_mode": cmd.get("mode", "auto")})
    began = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], params, lora_request=request, use_tqdm=False)
    seconds = time.perf_counter() - began
    stats = out[0].metrics  # vLLM's RequestStateStats: engine-core timestamps of the first and last token
    first, last = (getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)) if stats else (0.0, 0.0)
    return {"id": cmd.get("id"), "request_id": out[0].request_id, "tokens": list(out[0].outputs[0].token_ids),
            "seconds": seconds, "decode_s": last - first if last > first > 0 else None}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    llm = engine(spec)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip():
            print("RESULT " + json.dumps(answer(llm, spec.get("loras") or {}, json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
