"""Access control: per-user permissions on a real nats-server (a conf `shared.mesh.nats_auth` renders
for this file's roster), single-use grants on UCX pulls, tenant isolation (nobody reads another's
replies, speaks for another sender, joins another model's queue group or fills a store)."""

from __future__ import annotations

import asyncio
import secrets
import time

import msgspec
import nats
import pytest
import torch

from droidmesh.shared.errors import DroidMeshError, TransferError
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, render, sender_user
from droidmesh.shared.model import text
from droidmesh.shared.service.launch import start_nats, start_service
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.transport.pull import request_grant, requester
from droidmesh.shared.wire import schemas, subjects
from tests.system.conftest import until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.security]

# The running sender is `victim`; `rogue` is another sender's user (same model, its own id).
ROSTER = Roster(senders=(("victim", "sender"), ("rogue", "sender")), receivers=("receiver",))
VICTIM, ROGUE, RECEIVER = sender_user("victim"), sender_user("rogue"), receiver_user("receiver")
CONTEXT = words(120)
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_pair):
    """A nats-server with ROSTER's users and one copy of each service, each under its own user."""
    passwords = {u: secrets.token_hex(12) for u in ROSTER.users}
    conf = tmp_path_factory.mktemp("nats") / "nats-auth.conf"
    conf.write_text(render(ROSTER))
    env = {password_env(u): p for u, p in passwords.items()}
    proc, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")), conf=conf, env=env)
    procs = []
    try:
        # The bucket exists before readers start (readers may not create it).
        procs.append(start_service("profiler", {}, url, env=_user_env("profiler", passwords)))
        procs.append(start_service("cache_broker", {}, url, env=_user_env("broker", passwords)))
        procs.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [2],
                                              "sender_id": "victim",
                                              # a default group: no config declares the pair
                                              "readers": ["receiver"]}, url, env=_user_env(VICTIM, passwords)))
        procs.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver",
                                                "default_group": [2, 4]}, url, env=_user_env(RECEIVER, passwords)))
        yield url, passwords
    finally:
        for p in reversed(procs):
            p.stop()
        proc.stop()


def _user_env(user: str, passwords: dict[str, str]) -> dict[str, str]:
    return {**THREADS, "DM_NATS_USER": user, "DM_NATS_PASSWORD": passwords[user]}


async def _connect(url: str, user: str, passwords: dict[str, str], errors: list[str], own_inbox: bool = True):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    prefix = subjects.inbox_prefix(user) if own_inbox else subjects.INBOX_PREFIX
    return await nats.connect(url, user=user, password=passwords[user], error_cb=on_error, max_reconnect_attempts=0,
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
        rogue = await _connect(url, RECEIVER, pw, errors)
        forged = msgspec.structs.replace(seen[0], sender_id="rogue", address="127.0.0.1:1")
        await rogue.publish(subjects.cache_available("rogue"), schemas.encode(forged))
        await rogue.flush()
        # A sender trying to answer lookups: its subscription is refused.
        impostor = await _connect(url, ROGUE, pw, errors)
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
        recv = await _connect(url, RECEIVER, pw, errors)
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

        for pattern in ("_INBOX.>", f"{subjects.inbox_prefix(RECEIVER)}.>", "_INBOX_gateway.>", "_INBOX_admin.>", ">"):
            await spy.subscribe(pattern, cb=on_any)
        await spy.flush()

        prefilled = await admin_client.prefill("sender", context)
        await until_indexed(admin_client, tiny_models[1], context)
        client = await _client(url, pw)
        answer = await client.ask("receiver", context, " q", max_new_tokens=2)

        # Another sender (same role, its own id) withdraws the victim's context: on its own
        # subject, speaking for the victim, and on the subject senders shared before.
        rogue = await _connect(url, ROGUE, pw, errors)
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


def test_a_sender_cannot_announce_refresh_withdraw_or_take_grants_for_another(mesh, tiny_models):
    """sender-rogue cannot publish an availability event, heartbeat or eviction under the victim's
    id, nor take the victim's grant requests: the server refuses each, so the broker still has the
    victim holding its context at its own address."""
    url, pw = mesh
    context = words(120, offset=31)

    async def run():
        errors: list[str] = []
        admin = await _connect(url, "admin", pw, errors)
        admin_client = MeshClient(_Bus(admin))
        delivered: list[bytes] = []
        available: list[schemas.CacheAvailable] = []

        async def on_event(msg):
            delivered.append(msg.data)
            if msg.subject == subjects.cache_available("victim"):
                available.append(schemas.decode(msg.data, schemas.CacheAvailable))

        await admin.subscribe(f"{subjects.PREFIX}.cache.>", cb=on_event)
        await admin.flush()
        prefilled = await admin_client.prefill("sender", context)
        await until_indexed(admin_client, tiny_models[1], context)
        (real,) = [e for e in available if e.context_id == prefilled.context_id]

        rogue = await _connect(url, ROGUE, pw, errors)
        forged = {
            subjects.cache_available("victim"): schemas.encode(msgspec.structs.replace(real, address="127.0.0.1:1")),
            subjects.sender_heartbeat("victim"): schemas.encode(schemas.SenderHeartbeat(
                sender_id="victim", model_id="sender", context_ids=[], interval_s=1.0, sent_at=time.time())),
            subjects.cache_evicted("victim"): schemas.encode(
                schemas.CacheEvicted(sender_id="victim", context_id=prefilled.context_id)),
        }
        for subject, data in forged.items():
            await rogue.publish(subject, data)
        await rogue.subscribe(subjects.sender_grant("victim"), queue="grants")
        await _until_refused(rogue, errors, len(forged) + 1)
        await admin.flush()  # anything the server routed from the rogue has reached the admin by now
        still = await admin_client.lookup(text.context_ids(tiny_models[1].tokenizer, context),
                                          tiny_models[1].fingerprint.id)
        for c in (rogue, admin):
            await c.close()
        return forged, delivered, still, real, errors

    forged, delivered, still, real, errors = asyncio.run(run())
    for subject in forged:
        assert any("permissions violation for publish" in e.lower() and subject in e for e in errors), (subject, errors)
    assert any("permissions violation for subscription" in e.lower() and subjects.sender_grant("victim") in e
               for e in errors), errors
    assert not set(forged.values()) & set(delivered), "a forged event reached subscribers"
    assert still.holder is not None and (still.holder.sender_id, still.holder.address) == ("victim", real.address)


def test_a_receiver_may_join_only_its_own_models_queue_group(mesh):
    """receiver-<model> joins its own model's queue group; another model's group, and its own
    subject outside the group (a copy of every request), are refused by the server."""
    url, pw = mesh

    async def run():
        errors: list[str] = []
        nc = await _connect(url, RECEIVER, pw, errors)
        await nc.subscribe(subjects.receiver_generate("receiver"), queue=subjects.receiver_queue("receiver"))
        await nc.subscribe(subjects.receiver_generate("other"), queue=subjects.receiver_queue("other"))
        await nc.subscribe(subjects.receiver_generate("receiver"))
        await _until_refused(nc, errors, 2)
        await nc.close()
        return errors

    errors = asyncio.run(run())
    assert sorted(errors) == sorted([
        f'nats: permissions violation for subscription to "{subjects.receiver_generate("other")}" '
        f'using queue "{subjects.receiver_queue("other")}"',
        f'nats: permissions violation for subscription to "{subjects.receiver_generate("receiver")}"',
    ]), errors


async def _until_refused(nc, errors: list[str], n: int, rounds: int = 50) -> None:
    """Round trips until `n` refusals have reached the error callback (a refused subscription's
    error can arrive after the PONG of the flush that carried it), then one more for stragglers."""
    for _ in range(rounds):
        await nc.flush()
        if len(errors) >= n:
            break
    await nc.flush()


class _Bus:
    """A `Bus` over an existing nats connection (the admin's), for the client helper."""

    def __init__(self, nc):
        self.nc = nc

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        return (await self.nc.request(subject, data, timeout=timeout)).data
