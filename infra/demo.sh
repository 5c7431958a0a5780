#!/usr/bin/env bash
# The main job on a fresh machine: install (./.venv), then run DroidMesh's demo — a real mesh
# (nats-server, broker, senders, receivers as processes, UCX between them) over two zoo pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
mkdir -p out
exec .venv/bin/droidmesh demo --json out/demo.json --logs out/demo-logs "$@"
