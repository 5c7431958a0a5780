#!/usr/bin/env bash
# Install (if needed), lint and type-check, then run the whole test suite: unit, integration, system.
# With arguments, one pytest run with them (`bash infra/test.sh -x tests/unit`). Without, the unit
# and integration tiers run on two workers (pytest-xdist, one test file per worker at a time: they
# are in-process and share nothing between files), then the system tier on two workers the same
# way: its tests start real services on free ports, namespaces named by their own pid, and most of
# their time is waiting (start-up, deadlines), so two files at once share the CPU as a busy host
# would (the suite passes on one), in about 60 % of one worker's time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
# The vLLM environment the connector's system test runs (its own venv: vLLM pins torch and
# transformers), installed beside the checks and the first tiers, awaited before the system tier.
vllm_log=$(mktemp)
bash infra/vllm/install.sh > "$vllm_log" 2>&1 &
vllm_install=$!
vllm_ready() {
  if ! wait "$vllm_install"; then
    cat "$vllm_log" >&2
    echo "infra/vllm/install.sh failed" >&2
    exit 1
  fi
  tail -n 1 "$vllm_log"
}
.venv/bin/ruff check shared services tests
# mypy's cache outside the checkout: a fresh clone re-checks only what changed (mypy validates
# every cached file by its content's hash).
MYPY_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/droidmesh/mypy" .venv/bin/python infra/typecheck.py
.venv/bin/lint-imports --no-logo  # the layers point one way (pyproject.toml [tool.importlinter])
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "$(mktemp -d)"
if [ "$#" -gt 0 ]; then
  vllm_ready
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
.venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadfile tests/unit tests/integration
vllm_ready
exec .venv/bin/python -m pytest -q --durations=25 -n 2 --dist loadfile tests/system
