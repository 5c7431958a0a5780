"""`droidmesh config publish` refuses a choice that fails the test split unless --force; `config show` prints test beside train."""

from __future__ import annotations

import json
import socket

import msgspec
import pytest
from click.testing import CliRunner

from droidmesh.shared.tools.apps.serve_config import load_config
from droidmesh.shared.tools.cli.connect import Conn
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.zoo.manifest import REPO_ZOO

PROFILE = REPO_ZOO / "demo" / "profiles" / "base-to-qa.json"  # chosen: train 0.92, test 0.90; full prefill 0.92 / 0.90


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


def invoke(*argv: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(argv), env={"DM_DEBUG": ""})
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture
def failing(tmp_path) -> str:
    """The demo profile with its chosen group scoring 0.80 on the test split (< 0.95 x 0.90)."""
    data = json.loads(PROFILE.read_text())
    data["chosen"] = {**data["chosen"], "quality_test": 0.8}
    path = tmp_path / "failing.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_profile_passing_the_test_split_becomes_a_config_that_says_so():
    cfg = load_config(str(PROFILE))
    assert (cfg.chosen_quality_test, cfg.full_prefill_quality_test, cfg.passes_test) == (0.9, 0.9, True)


def test_publish_refuses_a_choice_failing_the_test_split_without_force(failing):
    """One `Error:` line naming the test qualities and --force; refused before connecting (no
    NATS runs here), and with --dry-run too."""
    for extra in (["--dry-run"], ["--nats", _closed_port(), "--timeout", "2"]):
        code, _, err = invoke("config", "publish", failing, *extra)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1, err
        assert "fails the test split (test 0.800 < 0.95 x full prefill 0.900)" in lines[0] and "--force" in lines[0]


def test_publish_with_force_accepts_it_and_the_config_records_the_failure(failing):
    code, out, err = invoke("config", "publish", failing, "--dry-run", "--force")
    assert code == 0, err
    cfg = json.loads(out)
    assert (cfg["passes_test"], cfg["chosen_quality_test"], cfg["full_prefill_quality_test"]) == (False, 0.8, 0.9)


def test_show_prints_test_quality_beside_train(failing, monkeypatch):
    """Each config's line: chosen quality on train and test, full prefill on train and test;
    a failing one says so; a config made before the check shows '-' for test."""
    good, bad = load_config(str(PROFILE)), load_config(failing, version=2)
    old = msgspec.structs.replace(load_config(str(PROFILE)), receiver_model="code", chosen_quality_test=None,
                                  full_prefill_quality_test=None, passes_test=None)
    bad = msgspec.structs.replace(bad, receiver_model="summ")
    monkeypatch.setattr(Conn, "run", lambda self, body, doing="": {"a": good, "b": bad, "c": old})
    code, out, err = invoke("config", "show")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "quality train 0.920 test 0.900 vs full prefill train 0.920 test 0.900)" in lines["base-to-qa.v" + str(
        good.profile_version)]
    assert "quality train 0.920 test 0.800 vs full prefill train 0.920 test 0.900, FAILS on test)" in lines["base-to-summ.v2"]
    assert "test - vs full prefill train 0.920 test -)" in lines["base-to-code.v" + str(old.profile_version)]
