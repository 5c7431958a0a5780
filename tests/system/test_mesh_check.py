"""`infra/gpu/mesh-check.sh --tiny`: the whole mesh on the CPU as it runs on a GPU: a real
nats-server with users, a sender process on a named shape's random-weight checkpoint serving over
the shm channel, and the receiver side in its own process timing every plan three ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_mesh_check_times_every_plan_through_the_mesh(tmp_path):
    out = tmp_path / "mesh.json"
    proc = subprocess.run(["bash", "infra/gpu/mesh-check.sh", "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["plan"]: r for r in report["rows"]}
    assert set(rows) == {"full reuse", "k=2 [3,5)"} and all(r["error"] is None for r in rows.values())
    assert all(r[k] > 0 for r in rows.values() for k in ("prefill_s", "mesh_s", "engine_s", "pull_s", "mesh_over_engine"))
    # the tiny shape: 8 layers, 2 KV heads of 32, hidden 128, float32 on the CPU; E at the group's start
    t = rows["full reuse"]["tokens"]
    per_layer = 2 * 2 * 32 * 4 * t
    assert rows["full reuse"]["bytes"] == 8 * per_layer and rows["k=2 [3,5)"]["bytes"] == 6 * per_layer + 128 * 4 * t
    assert set(report["targets"]) == {"llama3_8b_32k_k2_mesh_over_engine", "llama3_8b_32k_full_reuse_mesh_over_engine",
                                      "smollm2_2k_k2_prefill_over_mesh"}
    assert "full reuse" in proc.stdout and report["machine"]["transformers"]
