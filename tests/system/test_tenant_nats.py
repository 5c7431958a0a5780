"""Tenants on NATS, over a real nats-server running the conf `droidmesh nats-auth --tenant A
--tenant B` renders: each tenant's client user reads only its own reply inbox while receivers
stream to both, and availability events (every scope's token ids) reach the broker only."""

from __future__ import annotations

import asyncio
import secrets

import nats
import pytest
from click.testing import CliRunner

from droidmesh.shared.mesh.client import MeshClient, MeshError
from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, sender_user, tenant_user
from droidmesh.shared.service.launch import start_nats, start_service
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.channels import SenderEndpoint
from droidmesh.shared.wire.generation import GenerateChunk
from droidmesh.shared.wire.hashing import tenant_scope
from tests.system.conftest import until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.security]

ROSTER = Roster(senders=(("summ", "summ"),), receivers=("qa",), tenants=("A", "B"), holders=(("qa", "qa-hold"),))
TENANT_A, TENANT_B, RECEIVER = tenant_user("A"), tenant_user("B"), receiver_user("qa")
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_pair):
    """nats-server with the CLI's conf for ROSTER; broker, sender and receiver each as its own user
    (the receiver holds what it prefills, under its holder id)."""
    conf = tmp_path_factory.mktemp("nats") / "nats-auth.conf"
    out = CliRunner().invoke(main, ["nats-auth", "--sender", "summ=summ", "--receiver", "qa", "--tenant", "A",
                                    "--tenant", "B", "--holder", "qa=qa-hold", "--out", str(conf)])
    assert out.exit_code == 0, out.output
    pw = {u: secrets.token_hex(12) for u in ROSTER.users}
    proc, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")), conf=conf,
                           env={password_env(u): p for u, p in pw.items()})
    procs = []
    login = lambda user: {**THREADS, "DM_NATS_USER": user, "DM_NATS_PASSWORD": pw[user]}  # noqa: E731
    try:
        procs.append(start_service("profiler", {}, url, env=login("profiler")))  # makes the buckets readers watch
        procs.append(start_service("cache_broker", {}, url, env=login("broker")))
        procs.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "summ", "sender_id": "summ",
                                              "e_layers": [2], "readers": ["qa"]}, url, env=login(sender_user("summ"))))
        procs.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "qa", "default_group": [2, 4],
                                              "holder_id": "qa-hold"},
                                   url, env=login(RECEIVER)))
        yield url, pw
    finally:
        for p in reversed(procs):
            p.stop()
        proc.stop()


async def _raw(url: str, user: str, pw: dict[str, str], errors: list[str], inbox_prefix: str | None = None):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    return await nats.connect(url, user=user, password=pw[user], error_cb=on_error, max_reconnect_attempts=0,
                              inbox_prefix=inbox_prefix or subjects.inbox_prefix(user))


async def _streamed(client: MeshClient, context: str, scope: str) -> tuple[list[GenerateChunk], schemas.GenerateReply]:
    chunks, reply = [], None
    async for item in client.stream("qa", context, " what is gamma", max_new_tokens=3, timeout=120, scope=scope):
        if isinstance(item, GenerateChunk):
            chunks.append(item)
        else:
            reply = item
    assert reply is not None
    return chunks, reply


def test_a_tenant_cannot_read_another_tenants_replies_or_chunks(mesh):
    """client-A subscribing to B's inbox (or any other) is refused by the server and overhears
    nothing of B's streamed answer; the receiver streams to A and to B alike."""
    url, pw = mesh

    async def run():
        errors: list[str] = []
        spy = await _raw(url, TENANT_A, pw, errors)
        overheard: list[bytes] = []

        async def on_any(msg):
            overheard.append(msg.data)

        refused = (f"{subjects.inbox_prefix(TENANT_B)}.>", "_INBOX_client.>", "_INBOX.>", ">")
        for pattern in refused:
            await spy.subscribe(pattern, cb=on_any)
        await spy.flush()
        a = await MeshClient.connect(url, user=TENANT_A, password=pw[TENANT_A])
        b = await MeshClient.connect(url, user=TENANT_B, password=pw[TENANT_B])
        try:
            got_b = await _streamed(b, words(80, offset=3), tenant_scope("B"))
            got_a = await _streamed(a, words(80, offset=5), tenant_scope("A"))
            await spy.flush()
        finally:
            for c in (a, b):
                await c.close()
            await spy.close()
        return errors, overheard, refused, got_a, got_b

    errors, overheard, refused, got_a, got_b = asyncio.run(run())
    for chunks, reply in (got_a, got_b):
        assert chunks and reply.token_ids, "a receiver could not stream to a tenant's inbox"
    assert overheard == [], f"tenant A read {len(overheard)} messages meant for others"
    for pattern in refused:
        assert any("permissions violation for subscription" in e.lower() and f'"{pattern.lower()}"' in e.lower() for e in errors), \
            (pattern, errors)


def test_availability_events_reach_the_broker_and_not_receivers(mesh, tiny_models):
    """A receiver's user may not subscribe to availability events (they carry the token ids of
    every scope's contexts); it warms up on the sender's endpoint event, which carries none, and
    still reuses the sender's KV."""
    url, pw = mesh
    context = words(120, offset=41)

    async def run():
        errors: list[str] = []
        spy = await _raw(url, RECEIVER, pw, errors)
        heard: list[str] = []
        endpoints: list[SenderEndpoint] = []

        async def on_event(msg):
            heard.append(msg.subject)

        async def on_endpoint(msg):
            endpoints.append(schemas.decode(msg.data, SenderEndpoint))

        await spy.subscribe(subjects.CACHE_AVAILABLE_ALL, cb=on_event)
        await spy.subscribe(f"{subjects.PREFIX}.cache.>", cb=on_event)
        await spy.subscribe(subjects.SENDER_ENDPOINT_ALL, cb=on_endpoint)
        await spy.flush()
        admin = await MeshClient.connect(url, user="admin", password=pw["admin"])
        client = await MeshClient.connect(url, user=TENANT_A, password=pw[TENANT_A])
        try:
            await admin.prefill("summ", context, timeout=120)
            await until_indexed(admin, tiny_models[1], context)
            answer = await client.ask("qa", context, " what is gamma", max_new_tokens=2, timeout=120)
            await spy.flush()
        finally:
            for c in (admin, client):
                await c.close()
            await spy.close()
        return errors, heard, endpoints, answer

    errors, heard, endpoints, answer = asyncio.run(run())
    assert heard == [], f"a receiver's user heard {heard}"
    for pattern in (subjects.CACHE_AVAILABLE_ALL, f"{subjects.PREFIX}.cache.>"):
        assert any("permissions violation for subscription" in e.lower() and f'"{pattern.lower()}"' in e.lower() for e in errors), \
            (pattern, errors)
    assert endpoints and endpoints[0].sender_id == "summ" and endpoints[0].address
    assert answer.path == "partial" and answer.bytes_pulled > 0


def test_what_a_client_caused_to_be_held_is_its_own_and_no_oracle(mesh):
    """Client A asks over a document naming no scope: the receiver holds it as A's own, and A's
    repeat reuses it. Others asking for the first time: the mesh's `client` user sending the same
    document is its own full prefill (cached nothing); tenant B guessing the document's next word
    after a known opening reads the same reused-token count (0) for the right word as `admin` for a
    wrong one, so the count tells nothing of A's document."""
    url, pw = mesh
    secret = words(100, offset=61).split()
    wrong = words(1, offset=62)
    assert secret[80] != wrong

    async def run():
        users = (TENANT_A, TENANT_B, "client", "admin")
        c = {u: await MeshClient.connect(url, user=u, password=pw[u]) for u in users}
        ask = lambda u, words: c[u].ask("qa", " ".join(words), "", max_new_tokens=1, timeout=120)  # noqa: E731
        try:
            first, repeat = await ask(TENANT_A, secret), await ask(TENANT_A, secret)
            right, same = await ask(TENANT_B, secret[:81]), await ask("client", secret)
            control = await ask("admin", [*secret[:80], wrong])
        finally:
            for client in c.values():
                await client.close()
        return first, repeat, right, same, control

    first, repeat, right, same, control = asyncio.run(run())
    assert first.path == "full_prefill" and repeat.path == "full_reuse" and repeat.reused_tokens > 0, (first, repeat)
    assert (same.path, same.reused_tokens) == ("full_prefill", 0), same
    assert right.reused_tokens == control.reused_tokens == 0, (right, control)


def test_a_client_may_name_only_its_own_or_its_tenants_scope(mesh):
    """Tenant B's client user naming tenant A's scope, or client A's own scope, is refused with one
    line (what B could then reuse, look up or time is bound to who asks, not to who knows a name)."""
    url, pw = mesh

    async def run():
        b = await MeshClient.connect(url, user=TENANT_B, password=pw[TENANT_B])
        errors = []
        try:
            for scope in (tenant_scope("A"), f"user:{TENANT_A}"):
                with pytest.raises(MeshError) as refused:
                    await b.ask("qa", words(20, offset=7), "", max_new_tokens=1, timeout=60, scope=scope)
                errors.append(refused.value)
        finally:
            await b.close()
        return errors

    errors = asyncio.run(run())
    assert [e.code for e in errors] == ["bad_request", "bad_request"], errors
    assert "its tenant" in str(errors[0]) and "caller" in str(errors[1])
