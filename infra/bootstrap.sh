#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install DroidMesh with its dev and mesh extras.
# Idempotent: a venv whose install stamp matches pyproject.toml is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.droidmesh-install
# CUDA (opt-in): DM_TORCH_INDEX=https://download.pytorch.org/whl/cu130 DM_MESH_EXTRA=mesh-cu13
torch_index=${DM_TORCH_INDEX:-}
mesh_extra=${DM_MESH_EXTRA:-mesh}
want=$( (cat pyproject.toml; echo "$torch_index $mesh_extra") | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
# On hosts without a local CPU wheel, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
if [ -n "$torch_index" ]; then
  .venv/bin/python -m pip install -q --index-url "$torch_index" "torch==2.13.0"
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev,$mesh_extra]"
echo "$want" > "$stamp"
