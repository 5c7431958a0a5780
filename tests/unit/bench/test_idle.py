"""`bench idle`: the command's table, target line and JSON (a stubbed run: no mesh here; the
system test tier starts real services elsewhere)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from droidmesh.shared.tools.bench import idle as suite
from droidmesh.shared.tools.cli import bench as cli
from droidmesh.shared.tools.cli.bench import data_plane as bench_data_plane
from droidmesh.shared.tools.cli.bench.kit import DEFAULT_GROUPS


def test_idle_reports_each_process_against_the_target(monkeypatch, tmp_path):
    seen = {}

    def fake(sender, receiver, group, log_dir, *, transport, idle_s):
        seen.update(group=group, transport=transport, idle_s=idle_s)
        rows = [{"process": "sender", "cpu_s": 0.3, "core_share": 0.005, "meets_target": True},
                {"process": "receiver", "cpu_s": 1.2, "core_share": 0.02, "meets_target": False}]
        return {"rows": rows, "idle_s": 60.0, "transport": transport, "warm_path": "partial",
                "target_core_share": suite.TARGET, "log_dir": str(log_dir)}

    monkeypatch.setattr(suite, "run_idle", fake)
    monkeypatch.setattr(bench_data_plane, "demo_pair", lambda group: ("s", "r"))
    out = tmp_path / "idle.json"
    res = CliRunner().invoke(cli.bench, ["idle", "--transport", "shm", "--seconds", "5", "--json", str(out),
                                         "--log-dir", str(tmp_path / "logs")])
    assert res.exit_code == 0, res.output
    assert seen == {"group": DEFAULT_GROUPS["base"], "transport": "shm", "idle_s": 5.0}
    assert "core_share" in res.output and "shm: 1 of 2 processes at most 1% of a core over 60 s idle" in res.output
    assert [r["process"] for r in json.loads(out.read_text())["rows"]] == ["sender", "receiver"]


def test_idle_refuses_a_window_outside_its_range():
    res = CliRunner().invoke(cli.bench, ["idle", "--seconds", "0"])
    assert res.exit_code == 2 and "--seconds" in res.output
