"""The prepared GPU profile check (`infra/gpu/profile-check.sh`): its `--tiny` CPU run end to
end, on the real base's config and tokenizer (random weights, 8 layers). No timing is asserted;
on a GPU the same script times the real shape's profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_announces_then_measures_the_fidelity_profile(real_tier, tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(["bash", "infra/gpu/profile-check.sh", "--tiny", "--like", str(real_tier / "base"),
                           "--work", str(tmp_path / "pair"), "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["rows"] == {"train": 4, "test": 2}
    assert report["announced"].startswith("profile: ") and "fidelity search, 4 train + 2 test rows" in report["announced"]
    assert report["estimated_s"] > 0 and report["elapsed_s"] > 0
    assert report["elapsed_over_estimated"] == report["elapsed_s"] / report["estimated_s"]
    # random weights: nothing answers, so the race cannot drop a plan and runs every train row
    assert report["fidelity"]["race_rows"] == 4
    pair = [json.loads((tmp_path / "pair" / m / "config.json").read_text()) for m in ("sender", "receiver")]
    assert all(c["num_hidden_layers"] == 8 and c["vocab_size"] == 49152 for c in pair)
