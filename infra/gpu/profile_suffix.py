"""Where a reuse plan's time goes: `torch.profiler` tables (host and device time per op) of full
reuse and k = 2 on the llama3-8b shape at 4K and 64K tokens, on CUDA. Under a minute on one H200.
  PYTHONPATH=. python infra/gpu/profile_suffix.py [--tiny]
--tiny: the toy shape on the CPU at 256 tokens (host tables only).

Sequence per context: capture the context once, then per plan two warm-up generations and one
profiled generation of one token; print its TTFT and the op tables sorted by host time (and, on
CUDA, by device time). Device time far below host time means the pass is launch-bound.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model import shapes

QUESTION_TOKENS = 32
ROWS = 18


def main(tiny: bool) -> None:
    model = shapes.build("tiny" if tiny else "llama3-8b", "cpu" if tiny else "cuda")
    activities = [ProfilerActivity.CPU] + ([] if tiny else [ProfilerActivity.CUDA])
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for n in (256,) if tiny else (4096, 65536):
        ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompt = ctx + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist()
        source = CapturedSource(capture_prefill(model, ctx))
        for plan in (ReusePlan.full_reuse(), ReusePlan.recompute(0, 2)):
            for _ in range(2):
                generate(model, prompt, plan, source, max_new_tokens=1)
            with profile(activities=activities) as prof:
                took = generate(model, prompt, plan, source, max_new_tokens=1).ttft_s
            print(f"==== {n} tokens {plan.label()} ttft {took * 1e3:.1f} ms", flush=True)
            table = prof.key_averages()
            print(table.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=60))
            if not tiny:
                print(table.table(sort_by="self_cuda_time_total", row_limit=ROWS, max_name_column_width=60))
        del source
        if not tiny:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main("--tiny" in sys.argv[1:])
