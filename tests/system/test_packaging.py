"""The built wheel: what it installs, and that the demo runs from it outside a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

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
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    # The dependencies come from this venv's site-packages as a plain path entry: its .pth files
    # (among them the editable install of the checkout) are not processed, so `droidmesh` can only
    # come from the wheel.
    deps = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{deps}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    probe = subprocess.run([sys.executable, "-S", "-c", "import droidmesh; print(droidmesh.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(target)
    demo = subprocess.run([sys.executable, "-S", "-m", "droidmesh.shared.cli.main", "demo", "--rows", "1"],
                          cwd=run_dir, env=env, capture_output=True, text=True, timeout=420)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "base-to-qa" in demo.stdout and "partial" in demo.stdout
