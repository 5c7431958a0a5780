#!/usr/bin/env bash
# Install (if needed), lint and type-check, then run the whole test suite: unit, integration, system.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
.venv/bin/ruff check shared services tests
.venv/bin/python infra/typecheck.py
.venv/bin/lint-imports --no-logo  # the layers point one way (pyproject.toml [tool.importlinter])
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "$(mktemp -d)"
exec .venv/bin/python -m pytest -q --durations=25 "$@"
