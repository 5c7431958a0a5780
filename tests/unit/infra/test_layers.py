"""The layers point one way: `lint-imports` holds the contracts of `pyproject.toml`
(`[tool.importlinter]`), and there is no cycle between packages (`infra/import_graph.py`).

The planted tests copy the tree into a temporary `droidmesh` package, add one edge that breaks a
contract, and check that the same command then fails, naming the edge: so a green run here means
the contracts were read and checked, not skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(pythonpath: Path | None = None, *contracts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    args = [str(LINT), "--no-cache", "--no-logo", *(a for c in contracts for a in ("--contract", c))]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _planted(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of shared/ and services/ as `droidmesh.*` under `tmp_path`, with `line` added to
    `module` (a path under shared/ or services/)."""
    pkg = tmp_path / "droidmesh"
    for name in ("shared", "services"):
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    for data in ("nats_config", "zoo"):
        (pkg / data).mkdir(parents=True)  # the data packages the library looks up at import
    target = pkg / module
    target.write_text(target.read_text() + f"\n{line}\n")
    return tmp_path


def test_the_layer_contracts_hold() -> None:
    out = _lint()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_cycle_between_packages() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "infra" / "import_graph.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cycles between packages: 0" in out.stdout
    assert "shared.kv -> " in out.stdout  # the graph was built from our modules


@pytest.mark.parametrize(("module", "line", "contract", "edge"), [
    ("shared/kv/plan.py", "import droidmesh.shared.tools.cli.main", "layers",
     "droidmesh.shared.kv.plan -> droidmesh.shared.tools.cli.main"),
    ("shared/model/text.py", "import asyncio", "pure-core", "droidmesh.shared.model.text -> asyncio"),
    ("services/sender/config.py", "import droidmesh.services.receiver.config", "services",
     "droidmesh.services.sender.config -> droidmesh.services.receiver.config"),
])
def test_a_planted_edge_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str, edge: str) -> None:
    out = _lint(_planted(tmp_path, module, line), contract)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 broken" in out.stdout
    assert edge in " ".join(out.stdout.split()), out.stdout
