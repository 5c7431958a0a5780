"""The NATS roster renderer (shared/mesh/nats_auth.py), `droidmesh nats-auth`, and the shipped conf they make."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, Roster, password_env, render, tenant_user
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.channels import SenderEndpoint

SHIPPED = Path(__file__).resolve().parents[3] / "infra" / "nats" / "nats-auth.conf"


def _perms(conf: str, user: str) -> dict[str, list[str]]:
    """publish / subscribe allow lists of `user` in a rendered conf."""
    block = re.search(rf"{{ user: {re.escape(user)}, .*?(allow_responses: true }} }}|\] }} }} }})", conf, re.S)
    assert block, user
    return {kind: re.findall(r'"([^"]+)"', m) for kind, m in
            re.findall(r"(publish|subscribe):\s*\{ allow: \[(.*?)\] \}", block.group(0), re.S)}


def test_the_shipped_conf_is_the_default_roster_rendered():
    """infra/nats/nats-auth.conf is exactly `droidmesh nats-auth` for the shipped roster (no drift)."""
    assert SHIPPED.read_text() == render(DEFAULT_ROSTER)
    assert DEFAULT_ROSTER == Roster(senders=(("summ", "summ"),), receivers=("qa",),
                                    holders=tuple(("qa", f"receiver-{i}") for i in range(16)))


def test_a_sender_user_is_pinned_to_its_own_id():
    """sender-<id> publishes events and takes grants under its own id only, serves only its model."""
    conf = render(Roster(senders=(("a", "m"), ("b", "m")), receivers=()))
    a = _perms(conf, "sender-a")
    events = [s for s in a["publish"] if s.startswith(f"{subjects.PREFIX}.")]
    assert events == [subjects.cache_available("a"), subjects.cache_evicted("a"), subjects.sender_heartbeat("a"),
                      subjects.sender_endpoint("a")]
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


def test_a_holding_receiver_of_a_base_and_its_adapters_speaks_only_for_its_holder_id_and_models():
    """receiver-<base> with hosted adapters joins each of their queue groups; with a holder id it
    announces and takes grants under that id only; a receiver without one announces nothing."""
    roster = Roster.local((), ["base", "other"], hosted={"base": ["a", "b"]}, holders={"base": "base-h"})
    conf = render(roster)
    p, other = _perms(conf, "receiver-base"), _perms(conf, "receiver-other")
    assert [s for s in p["subscribe"] if ".receiver." in s] == [
        f"{subjects.receiver_generate(m)} {subjects.receiver_queue(m)}" for m in ("base", "a", "b")]
    assert {subjects.cache_available("base-h"), subjects.cache_evicted("base-h"), subjects.sender_heartbeat("base-h"),
            subjects.sender_endpoint("base-h")} <= set(p["publish"])
    assert subjects.sender_grant("base-h") in p["subscribe"] and subjects.BROKER_HELLO in p["subscribe"]
    assert not [s for s in other["publish"] if s.startswith(subjects.cache_available("").rstrip("."))]
    assert subjects.sender_grant("base-h") not in other["subscribe"]
    with pytest.raises(ValueError, match="not a receiver"):
        Roster.local((), ["base"], holders={"nobody": "h"})


def test_each_copy_of_a_receiver_may_speak_for_its_listed_holder_ids_only():
    """Several holder ids for one model (one per copy): the model's user may announce and grant
    under each, and under no other; an id named twice is refused."""
    conf = render(Roster(senders=(("s", "m"),), receivers=("qa",), holders=(("qa", "r-0"), ("qa", "r-1"))))
    qa = _perms(conf, "receiver-qa")
    for h in ("r-0", "r-1"):
        assert {subjects.cache_available(h), subjects.cache_evicted(h), subjects.sender_endpoint(h)} <= set(qa["publish"])
        assert subjects.sender_grant(h) in qa["subscribe"]
    assert subjects.cache_available("s") not in qa["publish"] and subjects.sender_grant("s") not in qa["subscribe"]
    assert qa["subscribe"].count(subjects.BROKER_HELLO) == 1
    with pytest.raises(ValueError, match="named twice"):
        Roster(senders=(("r-0", "m"),), receivers=("qa",), holders=(("qa", "r-0"),))


def test_each_tenant_reads_only_its_own_inbox_and_receivers_may_stream_to_every_one():
    """client-<tenant> asks receivers and subscribes to its own inbox prefix only (no
    allow_responses: it answers nothing); every receiver user may publish to each tenant's inbox."""
    conf = render(Roster(senders=(), receivers=("qa",), tenants=("A", "B")))
    for t, other in (("A", "B"), ("B", "A")):
        p = _perms(conf, tenant_user(t))
        assert p == {"publish": [subjects.RECEIVER_GENERATE_ALL], "subscribe": [f"_INBOX_client-{t}.>"]}
        assert subjects.inbox_prefix(tenant_user(t)) == f"_INBOX_client-{t}"
        assert f"_INBOX_client-{other}" not in str(p)
    block = re.search(r"\{ user: client-A, .*?\] \} \} \}", conf, re.S)
    assert block and "allow_responses" not in block.group(0)
    receiver = _perms(conf, "receiver-qa")
    assert {"_INBOX_client.>", "_INBOX_client-A.>", "_INBOX_client-B.>", "_INBOX_gateway.>"} <= set(receiver["publish"])


def test_availability_events_reach_the_broker_only():
    """Availability events carry every scope's token ids: only the broker subscribes to them;
    receivers warm up on senders' endpoint events, which carry none."""
    conf = render(Roster(senders=(("s", "m"),), receivers=("qa",), tenants=("A",)))
    for user in ("receiver-qa", "sender-s", tenant_user("A")):
        assert not [x for x in _perms(conf, user)["subscribe"] if x.startswith(f"{subjects.PREFIX}.cache.")], user
    assert subjects.SENDER_ENDPOINT_ALL in _perms(conf, "receiver-qa")["subscribe"]
    assert subjects.CACHE_EVENTS in _perms(conf, "broker")["subscribe"]
    assert "token_ids" not in {f.name for f in msgspec.structs.fields(SenderEndpoint)}


@pytest.mark.parametrize("roster,match", [
    (dict(senders=(("a.b", "m"),), receivers=()), "letters, digits"),
    (dict(senders=(), receivers=("",)), "letters, digits"),
    (dict(senders=(("a-b", "m"), ("a_b", "m")), receivers=()), "share a password variable"),
    (dict(senders=(), receivers=("qa", "qa")), "share a password variable"),
    (dict(senders=(), receivers=(), tenants=("a.b",)), "letters, digits"),
    (dict(senders=(), receivers=(), tenants=("acme", "ACME")), "share a password variable"),
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
    tenants = CliRunner().invoke(main, ["nats-auth", "--tenant", "A", "--tenant", "B", "--tenant", "A"])
    assert tenants.exit_code == 0 and tenants.output == render(Roster(DEFAULT_ROSTER.senders, DEFAULT_ROSTER.receivers,
                                                                      ("A", "B"), holders=DEFAULT_ROSTER.holders))
    for argv in (["--sender", "summ"], ["--receiver", "q.a"], ["--tenant", "a b"],
                 ["--receiver", "qa", "--holder", "qa=h", "--holder", "qa=h"]):
        bad = CliRunner().invoke(main, ["nats-auth", *argv])
        assert bad.exit_code != 0 and bad.output.count("\n") == 1 and bad.output.startswith("Error: "), bad.output
