"""Secure defaults: the local meshes DroidMesh starts itself (`droidmesh demo`, `droidmesh agents`,
the benchmarks) run nats-server under per-role users with fresh passwords, as deployments do, so
an anonymous connection is refused while the demo still completes with its usual table.

The other system tests start their own anonymous nats-server (`tests/system/conftest.py`) where
access control is not what they test; `test_security.py` covers the roles themselves."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import nats
import pytest

from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, sender_user
from droidmesh.shared.service.launch import Proc, start_secure_nats
from tests.system.venvs import PIN_RELAY

pytestmark = [pytest.mark.system, pytest.mark.security]

DEMO_TIMEOUT_S = 480.0  # `demo --rows 1` on a loaded 2-core machine, models loaded once per service
# The demo's table at --rows 1 (one test row per pair), as it was before the mesh ran under auth:
# (pair, path) -> (plan, quality).
DEMO_ROWS = {
    ("base-to-qa", "full_prefill"): ("full prefill", 1.0),
    ("base-to-qa", "full_reuse"): ("full reuse", 0.0),
    ("base-to-qa", "partial"): ("recompute [4,6)", 1.0),
    ("summ-to-qa", "full_prefill"): ("full prefill", 1.0),
    ("summ-to-qa", "full_reuse"): ("full reuse", 0.0),
    ("summ-to-qa", "partial"): ("recompute [0,6)", 1.0),
}
ROW = re.compile(r"^\s*(\S+)\s+(\S+)\s+(full_prefill|full_reuse|partial)\s+(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+([\d.]+)\s+([\d.]+)\s*$")


async def _refusal(url: str, **login: str) -> str | None:
    """Why the server refused a connection with `login` (None: it accepted it)."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    try:
        nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=5,
                                max_reconnect_attempts=0, **login)
    except Exception as e:  # nats-py raises its own kinds; the server's reason reached error_cb
        return " ".join(errors) or repr(e)
    await nc.close()
    return None


def test_the_launch_helper_admits_only_the_rosters_users(tmp_path: Path):
    """`start_secure_nats`: anonymous and wrong-password connections are refused, each user's own
    login is accepted, and the passwords are fresh per user and never written to the conf."""
    roster = Roster.local(["s1"], ["r1"])
    proc, access = start_secure_nats(roster, store_dir=str(tmp_path / "js"), log_dir=tmp_path)
    try:
        url = access.url
        assert "authorization violation" in (asyncio.run(_refusal(url)) or "").lower()
        wrong = {**access.options("client"), "password": access.password("admin")}
        assert "authorization violation" in (asyncio.run(_refusal(url, **wrong)) or "").lower()
        for user in (sender_user("s1"), receiver_user("r1"), "broker", "client", "admin"):
            assert asyncio.run(_refusal(url, **access.options(user))) is None, user
    finally:
        proc.stop()
    conf = (tmp_path / "nats-auth.conf").read_text()
    assert len(set(access.passwords.values())) == len(roster.users)
    assert not [p for p in access.passwords.values() if p in conf]
    assert f"${password_env(sender_user('s1'))}" in conf
    assert access.env_for("client") == {"DM_NATS_USER": "client", "DM_NATS_PASSWORD": access.password("client")}


def _droidmesh() -> list[str]:
    """This environment's `droidmesh` command."""
    script = Path(sys.executable).parent / "droidmesh"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from droidmesh.shared.tools.cli.main import main; main()"]


def test_the_demo_runs_under_auth_and_refuses_anonymous_connections(tmp_path: Path):
    """While `droidmesh demo --rows 1` runs, its nats-server refuses an anonymous connection;
    the demo then completes with its usual table: the profiled path is `partial`, every quality
    as it was before the mesh ran under auth."""
    logs = tmp_path / "logs"
    demo = Proc("demo", [*_droidmesh(), "demo", "--rows", "1", "--logs", str(logs)],
                env={"OMP_NUM_THREADS": "1", **PIN_RELAY})
    try:
        # The demo starts its senders once nats-server is ready, whose log names its port by then.
        demo.wait_for(lambda l: l.startswith("starting sender"), 300, "the mesh's nats-server")
        port = re.search(r"Listening for client connections on (\S+)", (logs / "nats.log").read_text())
        assert port, (logs / "nats.log").read_text()
        refused = asyncio.run(_refusal(f"nats://{port.group(1)}"))  # the server's own answer: the mesh is up
        assert refused is not None and "authorization violation" in refused.lower(), refused
        demo.popen.wait(DEMO_TIMEOUT_S)  # the table is printed as the process ends
    finally:
        rc = demo.stop()
    assert rc == 0, demo.tail(60)
    rows = {(m.group(1), m.group(3)): (m.group(4), float(m.group(8))) for m in map(ROW.match, demo.lines) if m}
    assert rows == DEMO_ROWS, "\n".join(demo.lines[-12:])
    # `droidmesh demo --rows 1`'s own output (test_cli leaves this invocation to this test): its header
    # names the tier and the pairs, and each row is one request
    assert "DroidMesh demo: tier demo, pairs base-to-qa (multihop_qa), summ-to-qa (multihop_qa)" in demo.lines
    assert {(m.group(2), m.group(5)) for m in map(ROW.match, demo.lines) if m} == {("multihop_qa", "1")}
