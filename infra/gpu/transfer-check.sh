#!/usr/bin/env bash
# Device-to-device pulls between two processes on one GPU (UCX channel) against the GPU's own copy
# bandwidth: a table on stdout, JSON in $OUT/gpu-transfer.json when OUT is set. Under 3 minutes.
#   infra/gpu/transfer-check.sh [--dry-run] [--sizes BYTES,...] [--repeats N]
# Without CUDA (or with --dry-run) it runs the same path on CPU tensors of tiny sizes.
# Sequence (steps 1-3: infra/gpu/prepare.sh):
#   1. Python: $PYTHON, else the repo's .venv, else python3 (torch is never installed);
#   2. with $WHEELS (a folder of carried wheels: msgspec, structlog and, for CUDA 13, ucxx-cu13,
#      libucxx-cu13, libucx-cu13, rmm-cu13, librmm-cu13, rapids-logger) install them offline,
#      without dependencies, into a scratch folder put on PYTHONPATH;
#   3. name every missing module DroidMesh needs and stop (exit 2), rather than a traceback;
#      a missing ucxx is reported by step 4, which still measures the copy reference;
#   4. python -m droidmesh.shared.tools.bench.gpu_transfer under a 170 s limit (exit 2: something was missing).
set -euo pipefail
cd "$(dirname "$0")/../.."

source infra/gpu/prepare.sh
require "torch=the machine's CUDA build (never installed by this script)" numpy=numpy xxhash=xxhash msgspec=msgspec structlog=structlog

require_project
exec timeout 170 "$py" -m droidmesh.shared.tools.bench.gpu_transfer "$@"
