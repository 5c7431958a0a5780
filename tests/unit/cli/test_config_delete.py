"""`droidmesh config delete`: withdraws a pair's configs; says which keys, or one line when there were none."""

from __future__ import annotations

from click.testing import CliRunner

from droidmesh.shared.tools.cli.connect import Conn
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.wire import subjects


def invoke(*argv: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(argv), env={"DM_DEBUG": ""})
    return res.exit_code, res.stdout, res.stderr


def test_delete_names_the_keys_it_withdrew(monkeypatch):
    monkeypatch.setattr(Conn, "run", lambda self, body, doing="": ["summ-to-qa.v1", "summ-to-qa.v2"])
    code, out, err = invoke("config", "delete", "--sender", "summ", "--receiver", "qa")
    assert code == 0, err
    assert out.strip() == f"withdrew summ-to-qa.v1, summ-to-qa.v2 from {subjects.CONFIG_BUCKET}"


def test_delete_of_a_pair_without_configs_is_one_error_line(monkeypatch):
    monkeypatch.setattr(Conn, "run", lambda self, body, doing="": [])
    code, _, err = invoke("config", "delete", "--sender", "summ", "--receiver", "qa", "--version", "3")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and lines == [f"Error: no config of summ -> qa version 3 in {subjects.CONFIG_BUCKET}"], err


def test_delete_names_both_models():
    code, _, err = invoke("config", "delete", "--sender", "summ")
    assert code == 2 and "--receiver" in err
