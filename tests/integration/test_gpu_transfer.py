"""The GPU transfer check (`infra/gpu/transfer-check.sh`): its dry run end to end on this CPU
(two processes, the UCX channel, the copy reference, the JSON), and its report when ucxx is
missing. No timing is asserted. On a GPU, the device-to-device path itself is
`test_ucx_cuda.py`'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from droidmesh.shared.tools.bench import gpu_transfer, nixl_reexport

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_end_to_end(tmp_path):
    proc = subprocess.run(["bash", "infra/gpu/transfer-check.sh", "--dry-run", "--sizes", "4096,65536", "--repeats", "1"],
                          cwd=ROOT, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DRY RUN on CPU" in proc.stdout and "pull/copy" in proc.stdout
    report = json.loads((tmp_path / "gpu-transfer.json").read_text())
    assert report["dry_run"] and report["missing"] == [] and report["path"] == "host (dry run)"
    assert [r["bytes"] for r in report["rows"]] == [4096, 65536]
    assert all(r["pull_gb_s"] > 0 and r["copy_gb_s"] > 0 and r["unavailable"] is None for r in report["rows"])
    shm = report["shm"]  # the shm channel's rows, plan and fixed cost: on the CPU over sealed memfds
    assert shm["missing"] is None and [r["bytes"] for r in shm["rows"]] == [4096, 65536]
    assert shm["plan"]["items"] == 60 and shm["plan"]["ratio"] > 0 and shm["fixed_us"] > 0
    assert shm["exports_skipped"] == 0  # no device here: nothing to export


def test_missing_ucxx_is_named_and_the_copy_reference_still_measured(monkeypatch):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # import ucxx raises ImportError
    report = gpu_transfer.measure([4096], torch.device("cpu"), 1)
    assert len(report["missing"]) == 1 and report["missing"][0].startswith("ucxx (") and "ucxx-cu13" in report["missing"][0]
    assert report["rows"][0]["copy_gb_s"] > 0 and report["rows"][0]["pull_gb_s"] is None
    assert "ucxx" in report["rows"][0]["unavailable"]


def test_missing_modules_stop_the_script_with_their_names(tmp_path):
    """A Python without DroidMesh's dependencies: the script names them, exit 2, no traceback."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages
    bare.chmod(0o755)
    proc = subprocess.run(["bash", "infra/gpu/transfer-check.sh", "--dry-run"], cwd=ROOT,
                          env={**os.environ, "PYTHON": str(bare)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "MISSING Python modules: torch" in proc.stderr and "Traceback" not in proc.stderr



def _children_running(role_module: str) -> list[int]:
    """Pids of this process's children running `role_module`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and role_module.encode() in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_the_reexport_probe_kills_a_child_that_misses_its_deadline():
    """No child answers within 0.2 s (each is still importing torch): the verdict says which and
    why, nothing is raised, and no child is left running."""
    t0 = time.monotonic()
    report = nixl_reexport.probe(torch.device("cpu"), deadline_s=0.2)
    assert report["outcome"] == "untested"
    assert report["verdict"] == "reexport: untested: owner: no answer within 0.2s"
    assert time.monotonic() - t0 < 2 * nixl_reexport.STOP_S  # terminated at once: none had answered
    assert set(report["logs"]) == {"owner", "sandbox", "reader"}
    assert _children_running(nixl_reexport.ROLES_MODULE) == []
