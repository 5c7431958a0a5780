"""The built wheel: what it installs, and that the demo runs from it outside a checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.system import venvs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel .` of this checkout (no build isolation: CI builds offline with its own setuptools)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT), "-w", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    (whl,) = out.glob("droidmesh-*.whl")
    return whl


def test_wheel_installs_one_namespace_with_its_data(wheel: Path):
    """Only `droidmesh` lands in site-packages, with the NATS configs, the demo tier and the license."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"droidmesh"}
    assert {"droidmesh/nats_config/nats.conf", "droidmesh/nats_config/nats-auth.conf",
            "droidmesh/zoo/demo/manifest.json", "droidmesh/services/receiver/__main__.py",
            "droidmesh/services/gateway/__main__.py"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in meta
    torch_deps = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_deps and all(">=" in d and "==" not in d for d in torch_deps)  # installs beside a serving engine's torch


def test_demo_runs_from_the_wheel_outside_the_checkout(wheel: Path, tmp_path: Path):
    """`droidmesh demo --rows 1` from the installed wheel in a directory outside the checkout."""
    # A fresh venv with the dependencies of this one but not its editable install of the checkout
    # (tests/system/venvs.py): `droidmesh` can only come from the wheel.
    venv = venvs.isolated_venv(tmp_path / "venv")
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    venvs.install(venv, wheel, cwd=run_dir)
    venvs.assert_installed_here(venv, run_dir)
    demo = venvs.run_demo(venv, run_dir)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "base-to-qa" in demo.stdout and "partial" in demo.stdout
