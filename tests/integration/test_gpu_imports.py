"""What a GPU session's steps run imports only what a GPU machine has or the session's archives
carry (`infra/gpu/carry.py`: `SESSION_CALLS`, `NOT_CARRIED`): a module one of them pulls in
that the machine lacks stops the step at its first line, and a lent GPU's call with it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, json, sys
modules, absent = json.loads(sys.argv[1])
found = {}
for name in modules:
    importlib.import_module(name)
    new = sorted(m for m in absent if m in sys.modules and m not in {x for v in found.values() for x in v})
    if new:
        found[name] = new
print(json.dumps(found))
"""


def _carry():
    spec = importlib.util.spec_from_file_location("carry", ROOT / "infra" / "gpu" / "carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("call", ["mesh", "nixl"])
def test_no_session_step_imports_a_module_the_gpu_machine_lacks_or_its_archive_does_not_carry(call):
    carry = _carry()
    modules, lacks = carry.SESSION_CALLS[call]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([modules, [*carry.NOT_CARRIED, *lacks]])],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}  # {first module that imports them: [them]}


def test_the_probe_names_the_module_that_pulls_one_in():
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([["json", "droidmesh.shared.tasks.measures"], ["rapidfuzz"]])],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"droidmesh.shared.tasks.measures": ["rapidfuzz"]}
