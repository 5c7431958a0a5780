#!/usr/bin/env bash
# The prepared GPU check: receiver TTFT of a Llama-3-8B-shaped bf16 model (random init, built on
# the GPU) at 4K-64K tokens per plan, peak memory, recompute-all exactness against the model's own
# forward, CacheBlend on CUDA, full reuse and k = 2 again with CUDA graphs (layer pieces replayed),
# batched decode (32 sequences at 4K against one: ragged, decode pool, pool replayed as graphs);
# tables on stdout and one JSON (--out FILE). Under 5 minutes on one H200.
#   infra/gpu/check.sh [--tiny] [--out FILE] [--shape llama3-8b|qwen2.5-7b|llama3.2-1b] [--contexts N,...]
# --tiny runs the same sequence on the CPU with a toy shape (what CI runs).
# Sequence (steps 1-3: infra/gpu/prepare.sh):
#   1. Python: $PYTHON, else the repo's .venv, else python3 (torch is never installed);
#   2. with $WHEELS (a folder of carried wheels: transformers, msgspec, structlog, ...) install
#      them offline, without dependencies, into a scratch folder put on PYTHONPATH;
#   3. name every missing module and stop (exit 2), rather than a traceback;
#   4. python -m droidmesh.shared.tools.bench.gpu_check under a 290 s limit (exit 1: exactness failed).
set -euo pipefail
cd "$(dirname "$0")/../.."

source infra/gpu/prepare.sh
require "torch=the machine's CUDA build (never installed by this script)" "transformers=transformers 5.x" numpy=numpy msgspec=msgspec structlog=structlog tqdm=tqdm

require_project
exec timeout 290 "$py" -m droidmesh.shared.tools.bench.gpu_check "$@"
