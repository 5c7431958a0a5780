#!/usr/bin/env bash
# The main job on a fresh machine: install, then run DroidMesh's demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
mkdir -p out
exec .venv/bin/droidmesh bench ttft --json out/ttft.json --plot out/ttft.png "$@"
