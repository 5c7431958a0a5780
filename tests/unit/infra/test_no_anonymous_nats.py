"""No anonymous NATS anywhere the project ships or tests: every conf shipped asks for a login; the
launch helpers, the only code that starts a nats-server, refuse a conf that does not
(`tests/integration/test_nats_login.py` shows a server they start refusing an anonymous client)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from droidmesh.shared.service.launch import conf_has_users, start_nats, start_nats_cluster

ROOT = Path(__file__).resolve().parents[3]
NATS_DIR = ROOT / "infra" / "nats"
LAUNCH = ROOT / "shared" / "service" / "launch.py"


def _k8s_confs(tmp_path: Path) -> list[Path]:
    """The confs k8s mounts (its ConfigMap), written beside copies of what they include."""
    out = []
    for doc in yaml.safe_load_all((ROOT / "infra" / "k8s" / "nats.yaml").read_text()):
        for name, text in ((doc or {}).get("data") or {}).items() if (doc or {}).get("kind") == "ConfigMap" else ():
            if name.endswith(".conf"):
                (tmp_path / name).write_text(text)
                out.append(tmp_path / name)
    return out


def test_every_shipped_conf_asks_for_a_login(tmp_path):
    confs = sorted(NATS_DIR.rglob("*.conf"))
    names = {str(p.relative_to(NATS_DIR)) for p in confs}
    assert {"nats.conf", "nats-auth.conf", "nats-tls.conf", "cluster/node.conf"} <= names, names
    k8s = _k8s_confs(tmp_path)
    assert {p.name for p in k8s} >= {"nats-auth.conf", "nats-tls.conf"}, k8s
    anonymous = [str(p) for p in [*confs, *k8s] if not conf_has_users(p)]
    assert not anonymous, f"confs that let anyone in: {anonymous}"


def test_compose_runs_nats_on_a_conf_with_users():
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    command = compose["services"]["nats"]["command"]
    assert conf_has_users(NATS_DIR / Path(command[command.index("-c") + 1]).name), command


def test_the_check_tells_a_conf_without_users(tmp_path):
    """What the checks above rest on: a conf without users, or one including only such a file, fails."""
    bare = tmp_path / "bare.conf"
    bare.write_text("server_name: x\njetstream {\n  max_memory_store: 1MB\n}\n")
    including = tmp_path / "including.conf"
    including.write_text("include ./bare.conf\n")
    empty_auth = tmp_path / "token.conf"
    empty_auth.write_text("authorization {\n  timeout: 2\n}\n")
    assert not any(conf_has_users(p) for p in (bare, including, empty_auth))
    for start in (lambda: start_nats(conf=bare), lambda: start_nats_cluster(1, conf=including)):
        with pytest.raises(ValueError, match="without users"):
            start()


def test_nats_servers_are_started_only_by_the_launch_helpers():
    """No test, bench or app runs `nats-server` itself, with whatever conf or none: only launch.py
    names the binary, in `start_nats` and `start_nats_cluster`, which refuse a conf without users."""
    named = [p for d in ("shared", "services", "tests", "infra") for p in (ROOT / d).rglob("*.py")
             if p != LAUNCH and re.search(r"nats_server_binary\(|\[\s*[\"']nats-server[\"']", p.read_text())]
    assert not named, named
    calls = re.findall(r"(?<!def )nats_server_binary\(\)", LAUNCH.read_text())
    assert len(calls) == 2, "start_nats and start_nats_cluster are the only starters"
