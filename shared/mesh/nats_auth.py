"""The NATS users and their permissions: infra/nats/nats-auth.conf, rendered from a roster.

A sender is pinned to its own id: it may publish events only under its own token
(`dm.cache.<kind>.<id>`) and take grant requests only on `dm.grant.<id>`, so it can neither
announce, refresh nor withdraw another sender's contexts. A receiver is pinned to its model: it may
join only that model's queue group (`dm.receiver.<model>.generate` in `receivers-<model>`) and ask
re-profiles only on that model's subject (`dm.profiler.reprofile.<model>`); it hears senders'
endpoints (`dm.endpoint.<id>`), not their availability events, whose token ids are the broker's.
Users are `sender-<id>` and `receiver-<model>`; each tenant of direct mesh clients may have its
own `client-<tenant>` user, which reads only its own reply inbox (`_INBOX_client-<tenant>`) and to
which receivers may stream; the other roles (broker, profiler, client, gateway, admin) are one user
each. Every subject comes from `shared.wire.subjects`, so the conf cannot drift from what the
services use; `droidmesh nats-auth` writes it, and the checked-in file is `render(DEFAULT_ROSTER)`
(a unit test holds them equal).

A local mesh (`droidmesh demo`, `droidmesh agents`, the benchmarks) runs the same conf for its own
roster (`Roster.local`) with a fresh random password per user: `MeshAccess` holds them and hands
each process only its own user's login (`env_for`, `options`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import string
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

from droidmesh.shared.mesh.discovery import RECEIVER_SERVICE
from droidmesh.shared.wire import subjects

FIXED_ROLES = ("broker", "profiler", "client", "gateway", "admin")
_ID = re.compile(r"^[A-Za-z0-9_-]+$")  # one subject token, one user-name part, one env-var part


def valid_id(name: str) -> bool:
    """Whether `name` can be a roster id (a sender, a model, a holder, a tenant)."""
    return bool(_ID.match(name))


def sender_user(sender_id: str) -> str:
    return f"sender-{sender_id}"


def receiver_user(model_id: str) -> str:
    return f"receiver-{model_id}"


def tenant_user(tenant: str) -> str:
    """A tenant's client user: asks receivers like `client`, reads only its own inbox."""
    return f"client-{tenant}"


def password_env(user: str) -> str:
    """The nats-server env variable holding `user`'s password: DM_NATS_PASSWORD_<USER>."""
    return "DM_NATS_PASSWORD_" + user.upper().replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Roster:
    """Who may log in: sender ids with the model each serves, the receivers' model ids, and the
    tenants that get a client user of their own."""

    senders: tuple[tuple[str, str], ...]  # (sender id, model id)
    receivers: tuple[str, ...]  # model ids
    tenants: tuple[str, ...] = ()  # client-<tenant> users
    # (receiver model id, the adapter model ids its processes serve too: one copy of the weights)
    hosted: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (receiver model id, a holder id one of its processes announces and grants what it prefills
    # under): a model may have several, one per copy, since two copies under one id would answer
    # each other's grant requests and overwrite each other's endpoint
    holders: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        extra = [i for _, ids in self.hosted for i in ids] + [h for _, h in self.holders]
        for model in [m for m, _ in self.hosted] + [m for m, _ in self.holders]:
            if model not in self.receivers:
                raise ValueError(f"{model!r} hosts adapters or holds contexts but is not a receiver of the roster")
        for name in [i for pair in self.senders for i in pair] + list(self.receivers) + list(self.tenants) + extra:
            if not valid_id(name):
                raise ValueError(f"{name!r}: ids in the NATS roster are letters, digits, '_' and '-' only")
        ids = [h for _, h in self.holders] + [i for i, _ in self.senders]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"ids {', '.join(dup)} are named twice among senders and holders: each process needs its own")
        envs = [password_env(u) for u in self.users]
        if len(set(envs)) != len(envs):  # e.g. sender ids `a-b` and `a_b`, or `A` and `a`
            dup = sorted({u for u, e in zip(self.users, envs, strict=True) if envs.count(e) > 1})
            raise ValueError(f"users {', '.join(dup)} would share a password variable: pick other ids")

    @property
    def users(self) -> list[str]:
        """Every user the rendered conf names, in its order."""
        return [*(sender_user(s) for s, _ in self.senders), *(receiver_user(m) for m in self.receivers),
                *(tenant_user(t) for t in self.tenants), *FIXED_ROLES]


    @classmethod
    def local(cls, senders: Iterable[str], receivers: Iterable[str], hosted: Mapping[str, Iterable[str]] | None = None,
              holders: Mapping[str, str] | None = None) -> Roster:
        """A local mesh's roster: one sender per model in `senders`, each with its model's name as
        its id (run it with `sender_id` = that name), and the receivers of `receivers`; repeats
        are one entry. `hosted`: receiver model -> the adapters its process serves too (run it
        with `adapters`); `holders`: receiver model -> the `holder_id` it holds its prefills under."""
        return cls(senders=tuple((m, m) for m in dict.fromkeys(senders)), receivers=tuple(dict.fromkeys(receivers)),
                   hosted=tuple((m, tuple(a)) for m, a in (hosted or {}).items()),
                   holders=tuple((holders or {}).items()))

    def served(self, model_id: str) -> tuple[str, ...]:
        """The models a receiver of `model_id` answers for: its own, then its hosted adapters."""
        return (model_id, *dict(self.hosted).get(model_id, ()))


# The shipped deployment (infra/compose.yaml, infra/k8s): one sender of /models/summ with
# DM_SENDER_SENDER_ID=summ, and two receivers of /models/qa, each holding what it prefills under
# its own id (DM_RECEIVER_HOLDER_ID: compose's service name, k8s' StatefulSet pod name), as many
# ids as k8s' autoscaler may run copies (infra/k8s/hpa-receiver.yaml's maxReplicas).
SHIPPED_RECEIVER_COPIES = 16
DEFAULT_ROSTER = Roster(senders=(("summ", "summ"),), receivers=("qa",),
                        holders=tuple(("qa", f"receiver-{i}") for i in range(SHIPPED_RECEIVER_COPIES)))


_ALNUM = string.ascii_letters + string.digits


def fresh_password() -> str:
    """32 random letters and digits (about 190 bits), a letter first: nats-server reads a
    `$VARIABLE`'s value as it would a conf value, so one that begins like a number (a size such as
    `12k`) could become one."""
    return secrets.choice(string.ascii_letters) + "".join(secrets.choice(_ALNUM) for _ in range(31))


@dataclasses.dataclass(frozen=True)
class MeshAccess:
    """The logins of a nats-server that runs `render(roster)`: its `url` and a password per user.
    The server gets them all (`server_env`); every other process gets only its own user's login
    (`env_for` for a launched service, `options` for a client in this process)."""

    url: str
    roster: Roster
    passwords: Mapping[str, str] = dataclasses.field(repr=False)  # user -> password; kept out of logs

    @classmethod
    def fresh(cls, roster: Roster, url: str = "") -> MeshAccess:
        """A new random password for every user of `roster` (`secrets`, never reused across meshes)."""
        return cls(url, roster, {u: fresh_password() for u in roster.users})

    def password(self, user: str) -> str:
        if user not in self.passwords:
            raise ValueError(f"{user!r} is not a user of this mesh's roster: {', '.join(self.roster.users)}")
        return self.passwords[user]

    def server_env(self) -> dict[str, str]:
        """nats-server's environment: the `$DM_NATS_PASSWORD_<USER>` variables the conf names."""
        return {password_env(u): p for u, p in self.passwords.items()}

    def env_for(self, user: str) -> dict[str, str]:
        """A launched service's login as `user` (its `DM_NATS_USER` / `DM_NATS_PASSWORD` settings)."""
        return {"DM_NATS_USER": user, "DM_NATS_PASSWORD": self.password(user)}

    def options(self, user: str) -> dict[str, Any]:
        """`nats.connect` / `MeshClient.connect` keywords for `user`, replies under its own inbox."""
        return {"user": user, "password": self.password(user), "inbox_prefix": subjects.inbox_prefix(user)}


def env_login() -> dict[str, Any]:
    """`nats.connect` keywords for the login `MeshAccess.env_for` put in this process's environment
    (a benchmark's helper process); {} when it has none (an anonymous server)."""
    user = os.environ.get("DM_NATS_USER", "")
    if not user:
        return {}
    return {"user": user, "password": os.environ.get("DM_NATS_PASSWORD", ""),
            "inbox_prefix": subjects.inbox_prefix(user)}


def _inbox(user: str) -> str:
    return f"{subjects.inbox_prefix(user)}.>"


def _kv_read(bucket: str, watch: bool) -> list[str]:
    """Reading a key-value bucket: plain gets, and with `watch` an ordered consumer over it."""
    stream = f"KV_{bucket}"
    gets = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]
    if not watch:
        return gets
    return ["$JS.API.INFO", gets[0], f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>", *gets[1:],
            f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


# Senders and receivers watch the recompute configs and read SCD maps files.
_KV_READ = _kv_read(subjects.CONFIG_BUCKET, watch=True) + _kv_read(subjects.MAPS_BUCKET, watch=False)
# The gateway's replicas share its keys' rate buckets: it makes the bucket if none is there, and
# gets and compare-and-sets its entries (a JetStream publish; the acknowledgement comes to its inbox).
_QUOTA_KV = [f"$JS.API.STREAM.CREATE.KV_{subjects.QUOTA_BUCKET}", *_kv_read(subjects.QUOTA_BUCKET, watch=False),
             f"$KV.{subjects.QUOTA_BUCKET}.>"]
_SRV = "$SRV.>"  # micro-service discovery (PING / INFO / STATS) of the services' endpoints


def _sender(sender_id: str, model_id: str) -> tuple[str, str, dict[str, list[str]]]:
    user = sender_user(sender_id)
    return (user, f"Sender {sender_id} (model {model_id}): events under its own id only, grants asked of it only.", {
        "publish": [subjects.cache_available(sender_id), subjects.cache_evicted(sender_id),
                    subjects.sender_heartbeat(sender_id), subjects.sender_endpoint(sender_id), _SRV, *_KV_READ],
        "subscribe": [subjects.sender_generate(model_id), subjects.sender_prefill(model_id),
                      subjects.sender_grant(sender_id), subjects.BROKER_HELLO, _inbox(user), _SRV]})


def _receiver(model_id: str, roster: Roster) -> tuple[str, str, dict[str, list[str]]]:
    user = receiver_user(model_id)
    askers = ("client", *(tenant_user(t) for t in roster.tenants), "gateway", "admin")
    models = roster.served(model_id)
    holders = [h for m, h in roster.holders if m == model_id]
    why = (f"Receivers of {model_id}: its queue group only; streamed chunks go to the asker's inbox; "
           "re-profile requests (quality watch) on its own model's subject only; senders' endpoints.")
    if len(models) > 1:
        why = (f"Receivers of {', '.join(models)} (a base and its adapters): those models' queue groups only; streamed "
               "chunks go to the asker's inbox; re-profile requests on their own models' subjects only; senders' endpoints.")
    # Senders' endpoints, not their availability events: those carry every scope's token ids.
    perms = {
        "publish": [subjects.BROKER_LOOKUP, subjects.SENDER_GRANT_ALL, *map(subjects.profiler_reprofile, models), _SRV,
                    *(_inbox(r) for r in askers), *_KV_READ],
        "subscribe": [*(f"{subjects.receiver_generate(m)} {subjects.receiver_queue(m)}" for m in models),
                      subjects.SENDER_ENDPOINT_ALL, _inbox(user), _SRV]}
    if holders:  # what it prefills it holds as a sender would: events and grants under its holder ids only
        why += f" Holds its prefills as {' or '.join(holders)} (one id per copy)."
        for holder in holders:
            perms["publish"] += [subjects.cache_available(holder), subjects.cache_evicted(holder),
                                 subjects.sender_heartbeat(holder), subjects.sender_endpoint(holder)]
            perms["subscribe"].append(subjects.sender_grant(holder))
        perms["subscribe"].append(subjects.BROKER_HELLO)
    return user, why, perms


def _tenant(tenant: str) -> tuple[str, str, dict[str, list[str]]]:
    user = tenant_user(tenant)
    return (user, f"Tenant {tenant}'s clients: ask receivers; read only their own inbox.", {
        "publish": [subjects.RECEIVER_GENERATE_ALL], "subscribe": [_inbox(user)]})


def _fixed() -> list[tuple[str, str, dict[str, list[str]] | None]]:
    kv = [f"$KV.{subjects.CONFIG_BUCKET}.>", f"$KV.{subjects.MAPS_BUCKET}.>"]
    return [
        ("broker", "Brokers: every sender's events (checked against the subject's id), lookups.", {
            "publish": [subjects.BROKER_HELLO, _SRV],
            "subscribe": [subjects.CACHE_EVENTS, subjects.BROKER_LOOKUP, _inbox("broker"), _SRV]}),
        ("profiler", "Profilers: write the config and maps buckets, watch the configs (versions, relay buckets).", {
            # $JS.FC: the flow-control answers of the ordered consumer that watches the config bucket
            "publish": ["$JS.API.>", f"$JS.FC.KV_{subjects.CONFIG_BUCKET}.>", *kv, _SRV],
            "subscribe": [subjects.PROFILER_PROFILE, subjects.PROFILER_REPROFILE_ALL, _inbox("profiler"), _SRV]}),
        ("client", "Clients may only ask receivers; replies and streamed chunks arrive on their own inboxes.", {
            "publish": [subjects.RECEIVER_GENERATE_ALL], "subscribe": [_inbox("client")]}),
        ("gateway", "The OpenAI gateway: asks receivers, discovers them ($SRV.INFO of their micro service), shares "
         "rate buckets with its replicas (the quota bucket only).", {
            "publish": [subjects.RECEIVER_GENERATE_ALL, f"$SRV.INFO.{RECEIVER_SERVICE}", *_QUOTA_KV],
            "subscribe": [_inbox("gateway")]}),
        ("admin", "Operators: prefill jobs, sender generate, profile requests, discovery, buckets.", None),
    ]


def _allow(kind: str, items: list[str]) -> str:
    head = f"        {kind + ':':<10} {{ allow: ["
    indent = " " * len(head)
    body = textwrap.fill(", ".join(f'"{s}"' for s in items), width=118, initial_indent=indent,
                         subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return head + body[len(indent):] + "] }"


def _user(user: str, why: str, perms: dict[str, list[str]] | None, responds: bool = True) -> list[str]:
    login = f"{{ user: {user}, password: ${password_env(user)}"
    if perms is None:
        return [f"    # {why}", f"    {login} }}"]
    # allow_responses: a service answers a request it received (its reply subject, once).
    return [f"    # {why}", f"    {login}, permissions: {{", _allow("publish", perms["publish"]),
            _allow("subscribe", perms["subscribe"]) + ("" if responds else " } }"),
            *(["        allow_responses: true } }"] if responds else [])]


HEADER = """\
# NATS users and their least-privilege permissions. GENERATED by `droidmesh nats-auth` from a roster
# (shared/mesh/nats_auth.py); this file is the shipped roster's: `droidmesh nats-auth --sender summ=summ
# --receiver qa --holder qa=receiver-0 ... --holder qa=receiver-15`. For yours, run it with your senders
# (ID=MODEL), receivers (MODEL) and a holder id per receiver copy (MODEL=ID), copy the output into
# infra/k8s/nats.yaml too, and re-run infra/secrets/generate.sh (a password per user).
# Passwords come from nats-server's environment ($DM_NATS_PASSWORD_<USER> references, '-' as '_'),
# never from this file. TLS: deployments run nats-tls.conf, which includes this file.
#
# Tenant isolation (what the server enforces):
# * Replies: each user connects with inbox prefix _INBOX_<user> (`shared.wire.subjects.inbox_prefix`;
#   services and the CLI do so from DM_NATS_USER) and may subscribe to that prefix only, so no user
#   can read another's replies. Services answer requests through allow_responses.
#   Users are the unit of isolation: give each tenant its own client user (`--tenant NAME`:
#   user client-NAME, inbox _INBOX_client-NAME, to which receivers may stream).
# * Availability events (with the token ids of every scope's contexts) are the broker's; receivers
#   warm their bulk connections from dm.endpoint.<sender> (a sender's address, no context).
# * Senders: user sender-<id> may publish availability / evictions / heartbeats only on
#   dm.cache.<kind>.<id> and take grant requests only on dm.grant.<id>; the broker refuses an event
#   whose sender_id is not its subject's token. So a sender speaks only for itself: run it with
#   DM_SENDER_SENDER_ID=<id> and DM_NATS_USER=sender-<id>. Each sender process needs its own id,
#   so scaling senders means one more roster entry (id, user, password) per copy.
# * Receivers: user receiver-<model> may join only that model's queue group (subject + queue).
#   NATS cannot tell two processes of one user apart: copies of one model trust each other.
# * Re-profiles: user receiver-<model> may ask the profiler only on dm.profiler.reprofile.<model>, which
#   tells the profiler who asks (it limits such requests to calibration rows, per receiver model);
#   dm.profiler.profile, where a request may name data files, versions and relay buckets, is admin's.
# * Pull grants: a sender sends a grant only to the inbox of receivers whose model may read its own
#   (the same model, one a pair config on the board names with it, or one in its DM_SENDER_READERS),
#   which only that receiver user can read; a receiver of another model is refused.
# * Filling a sender's store (prefill, and generate, which captures its context) is for operators
#   (admin) only: clients may ask receivers, nothing else.
server_name: droidmesh
max_payload: 1MB
jetstream {
  max_memory_store: 256MB
  max_file_store: 1GB
}
"""


def render(roster: Roster) -> str:
    """The whole nats-auth.conf for `roster`."""
    users = [*(_sender(s, m) for s, m in roster.senders), *(_receiver(m, roster) for m in roster.receivers),
             *(_tenant(t) for t in roster.tenants), *_fixed()]
    askers = {"client", "gateway", *(tenant_user(t) for t in roster.tenants)}  # they answer nothing
    lines = [HEADER, "authorization {", "  users = ["]
    for user, why, perms in users:
        lines += _user(user, why, perms, responds=user not in askers)
    return "\n".join([*lines, "  ]", "}", ""])
