"""The NATS roster renderer (shared/mesh/nats_auth.py), `droidmesh nats-auth`, and the shipped conf they make."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.cli.main import main
from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, Roster, password_env, render
from droidmesh.shared.wire import subjects

SHIPPED = Path(__file__).resolve().parents[3] / "infra" / "nats" / "nats-auth.conf"


def _perms(conf: str, user: str) -> dict[str, list[str]]:
    """publish / subscribe allow lists of `user` in a rendered conf."""
    block = re.search(rf"{{ user: {re.escape(user)}, .*?allow_responses: true }} }}", conf, re.S)
    assert block, user
    return {kind: re.findall(r'"([^"]+)"', m) for kind, m in
            re.findall(r"(publish|subscribe):\s*\{ allow: \[(.*?)\] \}", block.group(0), re.S)}


def test_the_shipped_conf_is_the_default_roster_rendered():
    """infra/nats/nats-auth.conf is exactly `droidmesh nats-auth` for the shipped roster (no drift)."""
    assert SHIPPED.read_text() == render(DEFAULT_ROSTER)
    assert DEFAULT_ROSTER == Roster(senders=(("summ", "summ"),), receivers=("qa",))


def test_a_sender_user_is_pinned_to_its_own_id():
    """sender-<id> publishes events and takes grants under its own id only, serves only its model."""
    conf = render(Roster(senders=(("a", "m"), ("b", "m")), receivers=()))
    a = _perms(conf, "sender-a")
    events = [s for s in a["publish"] if s.startswith(f"{subjects.PREFIX}.")]
    assert events == [subjects.cache_available("a"), subjects.cache_evicted("a"), subjects.sender_heartbeat("a")]
    assert subjects.sender_grant("a") in a["subscribe"] and subjects.sender_grant("b") not in a["subscribe"]
    assert not [s for s in a["subscribe"] if s.startswith(subjects.SENDER_GRANT) and s != subjects.sender_grant("a")]
    assert {subjects.sender_generate("m"), subjects.sender_prefill("m"), f"{subjects.inbox_prefix('sender-a')}.>"} \
        <= set(a["subscribe"])
    assert f"password: ${password_env('sender-b')}" in conf


def test_a_receiver_user_may_join_only_its_models_queue_group():
    """receiver-<model> subscribes to its model's generate subject in its queue group, no other."""
    p = _perms(render(Roster(senders=(), receivers=("qa", "code"))), "receiver-qa")
    generate = [s for s in p["subscribe"] if ".receiver." in s]
    assert generate == [f"{subjects.receiver_generate('qa')} {subjects.receiver_queue('qa')}"]
    assert f"{subjects.inbox_prefix('receiver-qa')}.>" in p["subscribe"]


@pytest.mark.parametrize("roster,match", [
    (dict(senders=(("a.b", "m"),), receivers=()), "letters, digits"),
    (dict(senders=(), receivers=("",)), "letters, digits"),
    (dict(senders=(("a-b", "m"), ("a_b", "m")), receivers=()), "share a password variable"),
    (dict(senders=(), receivers=("qa", "qa")), "share a password variable"),
])
def test_a_roster_that_cannot_be_rendered_is_refused(roster, match):
    """Ids that are not one subject token, or users whose password variables collide, are refused."""
    with pytest.raises(ValueError, match=match):
        Roster(**roster)


def test_the_cli_writes_a_conf_and_refuses_bad_input_in_one_line(tmp_path):
    """`droidmesh nats-auth --sender ID=MODEL --receiver MODEL --out F` writes the rendered roster;
    a sender without a model or a bad id is one `Error:` line and a non-zero exit."""
    out = tmp_path / "auth.conf"
    ok = CliRunner().invoke(main, ["nats-auth", "--sender", "s1=summ", "--receiver", "qa", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.read_text() == render(Roster(senders=(("s1", "summ"),), receivers=("qa",)))
    assert CliRunner().invoke(main, ["nats-auth"]).output == render(DEFAULT_ROSTER)
    for argv in (["--sender", "summ"], ["--receiver", "q.a"]):
        bad = CliRunner().invoke(main, ["nats-auth", *argv])
        assert bad.exit_code != 0 and bad.output.count("\n") == 1 and bad.output.startswith("Error: "), bad.output
