"""`droidmesh audit` end to end on the committed sample log: outputs written, mistakes in one line."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from droidmesh.shared.audit.relay import POLICY_SCHEMA
from droidmesh.shared.tools.cli.main import main

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "audit"


def invoke(*argv: str):
    return CliRunner().invoke(main, ["audit", *argv])


def test_audit_writes_table_json_plot_and_policy(tmp_path):
    """The sample log gives a table on stdout, the JSON, the PNG and the policy file."""
    out = tmp_path / "o"
    result = invoke("--logs", str(SAMPLE), "--json", str(out / "a.json"), "--plot", str(out / "a.png"),
                    "--policy", str(out / "p.json"), "--bootstrap", "300", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "reusable=[0.95,1]" in result.stdout and "worst stratum ratio" in result.stdout
    data = json.loads((out / "a.json").read_text())
    assert data["requests_used"] == 48 and data["files"] == 1 and data["bootstrap"] == 300 and data["seed"] == 3
    assert {"strata", "overall", "worst_stratum_ratio", "top_stratum_speedup", "prediction_error", "lines_read"} <= set(data)
    assert json.loads((out / "p.json").read_text())["schema"] == POLICY_SCHEMA
    assert (out / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_audit_is_reproducible():
    """The same seed prints the same report."""
    assert invoke("--logs", str(SAMPLE), "--bootstrap", "200").stdout == invoke("--logs", str(SAMPLE), "--bootstrap", "200").stdout


def test_missing_or_empty_logs_are_one_error_line(tmp_path):
    """A missing directory or one without usable lines: exit 1, one `Error:` line, no traceback."""
    (tmp_path / "noise.log").write_text("not json\n")
    for d in (tmp_path / "nosuch", tmp_path):
        result = invoke("--logs", str(d))
        assert result.exit_code == 1 and "Traceback" not in result.stderr
        assert result.stderr.startswith("Error: --logs") and len(result.stderr.strip().splitlines()) == 1
