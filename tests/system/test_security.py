"""Access control: role permissions on a real nats-server, single-use grants on UCX pulls,
tenant isolation (nobody reads another's replies, speaks for another sender or fills a store)."""

from __future__ import annotations

import asyncio
import secrets

import msgspec
import nats
import pytest
import torch

from droidmesh.shared.client import MeshClient
from droidmesh.shared.errors import DroidMeshError, TransferError
from droidmesh.shared.launch import NATS_AUTH_CONF, start_nats, start_service
from droidmesh.shared.model import text
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.transport.pull import request_grant, requester
from droidmesh.shared.wire import schemas, subjects
from tests.system.conftest import until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.security]

ROLES = ("sender", "broker", "receiver", "profiler", "client", "admin", "gateway")
CONTEXT = words(120)
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_pair):
    """A nats-server with role users and one copy of each service, each under its role."""
    passwords = {r: secrets.token_hex(12) for r in ROLES}
    env = {f"DM_NATS_PASSWORD_{r.upper()}": p for r, p in passwords.items()}
    proc, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")), conf=NATS_AUTH_CONF, env=env)
    procs = []
    try:
        # The bucket exists before readers start (readers may not create it).
        procs.append(start_service("profiler", {}, url, env=_role_env("profiler", passwords)))
        procs.append(start_service("cache_broker", {}, url, env=_role_env("broker", passwords)))
        procs.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [2],
                                              "sender_id": "victim"}, url, env=_role_env("sender", passwords)))
        procs.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver",
                                                "default_group": [2, 4]}, url, env=_role_env("receiver", passwords)))
        yield url, passwords
    finally:
        for p in reversed(procs):
            p.stop()
        proc.stop()


def _role_env(role: str, passwords: dict[str, str]) -> dict[str, str]:
    return {**THREADS, "DM_NATS_USER": role, "DM_NATS_PASSWORD": passwords[role]}


async def _connect(url: str, role: str, passwords: dict[str, str], errors: list[str], own_inbox: bool = True):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    prefix = subjects.inbox_prefix(role) if own_inbox else subjects.INBOX_PREFIX
    return await nats.connect(url, user=role, password=passwords[role], error_cb=on_error, max_reconnect_attempts=0,
                              inbox_prefix=prefix)


async def _client(url: str, passwords: dict[str, str]) -> MeshClient:
    return await MeshClient.connect(url, user="client", password=passwords["client"],
                                    inbox_prefix=subjects.inbox_prefix("client"))


def test_roles_work_and_unauthorized_users_are_refused(mesh, tiny_models):
    """Each role does its job under least privilege; a receiver cannot forge availability
    events, a sender cannot answer lookups, a client cannot prefill or ask for pull grants, and a
    pull without a valid, unused grant is refused."""
    url, pw = mesh

    async def run():
        errors: list[str] = []
        admin = await _connect(url, "admin", pw, errors)
        seen: list[schemas.CacheAvailable] = []

        async def on_available(msg):
            seen.append(schemas.decode(msg.data, schemas.CacheAvailable))

        await admin.subscribe(subjects.CACHE_AVAILABLE_ALL, cb=on_available)
        await admin.flush()
        admin_client = MeshClient(_Bus(admin))
        await admin_client.prefill("sender", CONTEXT)
        await until_indexed(admin_client, tiny_models[1], CONTEXT)
        client = await _client(url, pw)
        answer = await client.ask("receiver", CONTEXT, " q", max_new_tokens=2)

        # A receiver forging an availability event: refused by the server, never delivered.
        rogue = await _connect(url, "receiver", pw, errors)
        forged = msgspec.structs.replace(seen[0], sender_id="rogue", address="127.0.0.1:1")
        await rogue.publish(subjects.cache_available("rogue"), schemas.encode(forged))
        await rogue.flush()
        # A sender trying to answer lookups: its subscription is refused.
        impostor = await _connect(url, "sender", pw, errors)
        await impostor.subscribe(subjects.BROKER_LOOKUP, queue=subjects.BROKER_QUEUE)
        await impostor.flush()
        # A client trying to run a prefill job: refused.
        with pytest.raises(Exception):  # noqa: B017 - nats-py reports the refused publish as a timeout or an error reply
            await client.prefill("sender", words(100, offset=3), timeout=2)

        # A UCX pull needs a single-use grant, which only the receiver role may ask a sender for:
        # the event and the lookup reply carry none; a missing, tampered, another context's or an
        # already used grant is refused; a client asking for one is refused by the server.
        ev = seen[0]
        assert "pull_token" not in msgspec.to_builtins(ev)
        recv = await _connect(url, "receiver", pw, errors)
        ask = requester(recv)
        other = await admin_client.prefill("sender", words(100, offset=5))
        grants = {"good": await request_grant(ask, ev, 5), "used": await request_grant(ask, ev, 5),
                  "other-context": await request_grant(ask, msgspec.structs.replace(ev, context_id=other.context_id), 5)}
        bulk = make_client("ucx")
        one = schemas.PullRequest(context_id=ev.context_id, items=[schemas.PullItem(0, "K")], token=grants["used"])
        with pytest.raises(DroidMeshError):  # served (then refused here: a 1-element buffer), and the grant used up
            await bulk.pull(ev.address, one, [torch.empty(1)], lambda *a: None, 10)
        tokens = {"missing": "", "tampered": grants["good"][:-4] + "0000", "other-context": grants["other-context"],
                  "used": grants["used"]}
        refusals = []
        for name, token in tokens.items():
            req = schemas.PullRequest(context_id=ev.context_id, items=[schemas.PullItem(0, "K")], token=token)
            try:
                await bulk.pull(ev.address, req, [torch.empty(1)], lambda *a: None, 10)
                refusals.append((name, None))
            except TransferError as e:
                refusals.append((name, str(e)))
        client_nc = await _connect(url, "client", pw, errors)
        with pytest.raises(TransferError, match="no pull grant"):
            await request_grant(requester(client_nc), ev, 1)
        await client_nc.close()
        await recv.close()
        await bulk.close()
        await admin.flush()  # anything the server delivered to the admin has arrived by now
        forged_seen = [e for e in seen if e.sender_id == "rogue"]
        for c in (rogue, impostor, admin):
            await c.close()
        await client.close()
        return answer, forged_seen, errors, refusals

    answer, forged_seen, errors, refusals = asyncio.run(run())
    assert answer.path == "partial"
    assert forged_seen == []
    assert any("permissions violation for publish" in e.lower() and subjects.cache_available("rogue") in e
               for e in errors), errors
    assert any("permissions violation for subscription" in e.lower() and subjects.BROKER_LOOKUP in e for e in errors), errors
    for name, err in refusals:
        assert err is not None and "unauthorized" in err, (name, err)
    assert dict(refusals)["used"] is not None and "already used" in dict(refusals)["used"]
    assert any("permissions violation for publish" in e.lower() and subjects.sender_grant("victim") in e
               for e in errors), errors


def test_tenants_cannot_read_replies_speak_for_senders_or_fill_stores(mesh, tiny_models):
    """A client cannot read anyone's replies (lookup replies with grants, other clients' answers),
    a sender cannot withdraw another sender's context, and a client cannot make a sender
    capture a context through any subject."""
    url, pw = mesh
    context = words(120, offset=11)

    async def run():
        errors: list[str] = []
        admin = await _connect(url, "admin", pw, errors)
        admin_client = MeshClient(_Bus(admin))
        announced: list[str] = []

        async def on_available(msg):
            announced.append(schemas.decode(msg.data, schemas.CacheAvailable).context_id)

        await admin.subscribe(f"{subjects.CACHE_AVAILABLE}.>", cb=on_available)
        await admin.subscribe(subjects.CACHE_AVAILABLE, cb=on_available)  # where senders announced before
        # An eavesdropper with client credentials tries every inbox it can name.
        spy = await _connect(url, "client", pw, errors, own_inbox=False)
        overheard: list[bytes] = []

        async def on_any(msg):
            overheard.append(msg.data)

        for pattern in ("_INBOX.>", "_INBOX_receiver.>", "_INBOX_gateway.>", "_INBOX_admin.>", ">"):
            await spy.subscribe(pattern, cb=on_any)
        await spy.flush()

        prefilled = await admin_client.prefill("sender", context)
        await until_indexed(admin_client, tiny_models[1], context)
        client = await _client(url, pw)
        answer = await client.ask("receiver", context, " q", max_new_tokens=2)

        # Another sender (same role, its own id) withdraws the victim's context: on its own
        # subject, speaking for the victim, and on the subject senders shared before.
        rogue = await _connect(url, "sender", pw, errors)
        withdraw = schemas.encode(schemas.CacheEvicted(sender_id="victim", context_id=prefilled.context_id))
        for subject in (subjects.cache_evicted("rogue"), subjects.CACHE_EVICTED):
            await rogue.publish(subject, withdraw)
        await rogue.flush()
        # A client asks a sender to answer over a new context (which would capture and announce it).
        sneaky = words(100, offset=21)
        try:
            await client.sender_generate("sender", sneaky, " q", max_new_tokens=1, timeout=2)
            filled = True
        except Exception:  # refused by the server: no responder reachable for this user
            filled = False
        await admin.flush()
        still = await admin_client.lookup(text.context_ids(tiny_models[1].tokenizer, context), tiny_models[1].fingerprint.id)
        await spy.flush()
        for c in (rogue, spy, admin):
            await c.close()
        await client.close()
        return answer, overheard, still, filled, announced, errors, prefilled.context_id

    answer, overheard, still, filled, announced, errors, prefilled_id = asyncio.run(run())
    assert answer.path == "partial"
    assert overheard == [], f"a client read {len(overheard)} messages meant for others"
    assert any("permissions violation for subscription" in e.lower() and "_inbox.>" in e.lower() for e in errors), errors
    assert still.holder is not None and still.holder.sender_id == "victim", "another sender withdrew the victim's context"
    assert not filled
    assert set(announced) == {prefilled_id}, "a client made the sender capture a context"


class _Bus:
    """A `Bus` over an existing nats connection (the admin's), for the client helper."""

    def __init__(self, nc):
        self.nc = nc

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        return (await self.nc.request(subject, data, timeout=timeout)).data
