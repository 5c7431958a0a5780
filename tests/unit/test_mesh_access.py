"""A local mesh's logins (`shared.mesh.nats_auth.MeshAccess`, `Roster.local`): fresh passwords per
user, each process handed only its own, none in a repr."""

from __future__ import annotations

import pytest

from droidmesh.shared.mesh.nats_auth import (
    MeshAccess,
    Roster,
    env_login,
    fresh_password,
    password_env,
    receiver_user,
    render,
    sender_user,
)
from droidmesh.shared.wire import subjects


def test_a_local_roster_names_each_sender_by_its_model_once():
    roster = Roster.local(["base", "summ", "base"], ["qa", "qa", "code"])
    assert roster == Roster(senders=(("base", "base"), ("summ", "summ")), receivers=("qa", "code"))
    assert sender_user("base") in roster.users and receiver_user("code") in roster.users


def test_passwords_are_fresh_per_user_and_per_mesh_and_begin_with_a_letter():
    roster = Roster.local(["s"], ["r"])
    one, two = MeshAccess.fresh(roster), MeshAccess.fresh(roster)
    assert set(one.passwords) == set(roster.users)
    assert len(set(one.passwords.values())) == len(roster.users)
    assert not set(one.passwords.values()) & set(two.passwords.values())
    for p in [fresh_password() for _ in range(200)]:
        assert len(p) == 32 and p.isalnum() and p.isascii() and p[0].isalpha()


def test_each_process_gets_only_its_own_login():
    """The server gets every password under the names the rendered conf references; a service
    and a client get their own user's only; an unknown user is refused; no repr shows one."""
    roster = Roster.local(["s"], ["r"])
    access = MeshAccess.fresh(roster, "nats://127.0.0.1:1")
    conf = render(roster)
    assert set(access.server_env()) == {password_env(u) for u in roster.users}
    assert all(f"${name}" in conf for name in access.server_env())
    user = receiver_user("r")
    assert access.env_for(user) == {"DM_NATS_USER": user, "DM_NATS_PASSWORD": access.passwords[user]}
    assert access.options("client") == {"user": "client", "password": access.passwords["client"],
                                        "inbox_prefix": subjects.inbox_prefix("client")}
    with pytest.raises(ValueError, match="not a user"):
        access.env_for(sender_user("other"))
    assert not [p for p in access.passwords.values() if p in repr(access)]


def test_a_helper_process_reads_its_login_from_the_environment(monkeypatch):
    access = MeshAccess.fresh(Roster.local([], []))
    monkeypatch.delenv("DM_NATS_USER", raising=False)
    assert env_login() == {}
    for k, v in access.env_for("admin").items():
        monkeypatch.setenv(k, v)
    assert env_login() == access.options("admin")
