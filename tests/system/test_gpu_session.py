"""`infra/gpu/session.sh`: the prepared GPU checks in one device call, in order, within a budget:
a step whose limit does not fit in the time left is named and never started, a bad step name
stops before anything runs, and a step that runs leaves its log and JSON in $OUT."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]


def _session(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "infra/gpu/session.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)})


def test_a_step_that_cannot_finish_in_the_budget_left_is_named_and_not_started(tmp_path):
    proc = _session(tmp_path, "--budget", "200", "--steps", "mesh,transfer")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SKIPPED mesh: its limit is 295s and 200s" in proc.stdout and "SKIPPED transfer" not in proc.stdout
    assert "== transfer: exit" in proc.stdout  # 175 s fit the 200 left: started (without CUDA, its dry run)
    assert not (tmp_path / "mesh.log").exists() and (tmp_path / "transfer.log").exists()


@pytest.mark.parametrize("args,message", [(["--steps", "transfer,graphs"], "unknown step 'graphs'"),
                                          (["--budget", "ten"], "a whole number of seconds")])
def test_bad_arguments_stop_before_any_step_runs(tmp_path, args, message):
    proc = _session(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr and list(tmp_path.iterdir()) == []


def test_the_tiny_transfer_step_leaves_its_log_and_json(tmp_path):
    proc = _session(tmp_path, "--tiny", "--steps", "transfer")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== transfer: exit 0" in proc.stdout and "session:" in proc.stdout
    report = json.loads((tmp_path / "gpu-transfer.json").read_text())
    assert report["dry_run"] and [r["bytes"] for r in report["rows"]] == [4096, 65536]


def test_the_tiny_nixl_step_measures_the_channel_beside_nixl_itself(tmp_path):
    """The nixl step's own JSON (beside the transfer step's): the channel and NIXL's own READ on the
    same memory (on the CPU, host memory), per size and for a plan; no ucx or shm rows. First, its
    re-export probe: a sandbox process registers memory it holds only as an import (on the CPU the
    owner's memfd) with NIXL, and a third process READs it, bytes checked."""
    proc = _session(tmp_path, "--tiny", "--steps", "nixl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu-transfer-nixl.json").read_text())
    assert report["rows"] == [] and report["shm"] is None and not report["missing"]
    nixl = report["nixl"]
    assert [r["bytes"] for r in nixl["rows"]] == [4096, 65536] and nixl["missing"] is None
    assert all(r["nixl_gb_s"] > 0 and r["nixl_raw_gb_s"] > 0 for r in nixl["rows"])
    assert nixl["plan"]["items"] == 60 and nixl["plan"]["nixl_over_raw"] > 0
    kept = nixl["raw_metadata"]  # what a GPU run keeps for the metadata screen: here, host memory's
    assert kept["memory"] == "DRAM" and kept["regions"] == 2
    assert kept["screen"] == "accepted: 2 descriptors"  # the receiver's screen passes NIXL's own metadata
    assert base64.b64decode(kept["metadata_b64"]).startswith(b"nixlSerDes|")
    assert not (tmp_path / "gpu-transfer.json").exists()
    probe = report["reexport"]  # its verdict in the step's log and JSON
    assert probe["outcome"] == "works" and probe["verdict"].startswith("reexport: works at "), probe
    assert probe["verdict"] in proc.stdout and probe["memory"] == "DRAM" and probe["bytes"] == 1 << 20
    assert probe["own"]["match"] and probe["import"]["match"] and probe["import"]["gb_s"] > 0
    assert probe["import"]["transport"]  # read from the reader's UCX tables
    assert probe["screen"] == "accepted: 1 descriptors"  # the receiver's screen passes the import's keys
