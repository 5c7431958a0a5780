#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit, integration, system.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
