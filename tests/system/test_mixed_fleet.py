"""A fleet mixing two builds: a peer of the previous schema version is refused at its first
message, cleanly (an error naming the version, nothing indexed, nothing pulled from it), and the
refusal is logged once an interval, not once a message; the current build's peers go on working."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest
from tests.system.conftest import run

pytestmark = pytest.mark.system

OLD = schemas.SCHEMA_VERSION - 1
TOKENS = list(range(100, 164))
FINGERPRINT = schemas.Fingerprint(model_type="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                                  head_dim=16, rope="default", vocab_hash="ab" * 8)


def _as(version: int, msg: schemas.Message) -> bytes:
    """`msg` as a build speaking `version` sends it (the same fields: the schema change between
    the two builds is elsewhere)."""
    return msgspec.msgpack.encode({**msgspec.msgpack.decode(schemas.encode(msg)), "v": version})


async def _announce(client: MeshClient, sender_id: str, version: int) -> None:
    """What a sender sends once it holds a context: its availability event, then a heartbeat
    listing it (the broker serves only live senders' holders)."""
    ev = schemas.CacheAvailable(
        sender_id=sender_id, model_id="m", model_sha256="0" * 64, fingerprint=FINGERPRINT, fingerprint_id="fp-mixed",
        context_id=f"ctx-{sender_id}", token_ids=TOKENS, dtype="float32", kv_nbytes=[4096] * 4, e_layers=[1],
        e_nbytes=2048, transport="ucx", address="127.0.0.1:9", published_at=time.time())
    hb = schemas.SenderHeartbeat(sender_id=sender_id, model_id="m", context_ids=[ev.context_id], interval_s=5.0,
                                 sent_at=time.time())
    await client.bus.publish(subjects.cache_available(sender_id), _as(version, ev))
    await client.bus.publish(subjects.sender_heartbeat(sender_id), _as(version, hb))


async def _lookup_holder(client: MeshClient, tries: int = 100) -> str | None:
    """The holder the broker answers for TOKENS, once it has one (or None after `tries`)."""
    for _ in range(tries):
        reply = await client.lookup(TOKENS, "fp-mixed")
        if reply.holder is not None:
            return reply.holder.sender_id
        await asyncio.sleep(0.05)
    return None


def test_a_peer_of_the_previous_version_is_refused_at_once_and_logged_once(nats, services, tiny_pair):
    services.append(start_service("cache_broker", {}, nats[1]))
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver"}, nats[1]))

    async def scenario():
        client = await MeshClient.connect(nats[1])
        try:
            for _ in range(10):  # an old sender announcing, as it would on every prefill
                await _announce(client, "old", OLD)
            old_holder = await _lookup_holder(client, tries=20)
            # the control: the same event from this build is indexed (the broker is not refusing all)
            await _announce(client, "new", schemas.SCHEMA_VERSION)
            new_holder = await _lookup_holder(client)
            # an old client asking this build's receiver
            req = msgspec.msgpack.decode(schemas.encode(GenerateRequest(
                request_id=uuid.uuid4().hex, context="a b c", question=" d", max_new_tokens=2)))
            raw = await client.bus.request(subjects.receiver_generate("receiver"),
                                           msgspec.msgpack.encode({**req, "v": OLD}), timeout=30)
            refusal = schemas.decode(raw, schemas.ErrorReply)
            # and this build's own client is served as ever
            served = await client.ask("receiver", "a b c", " d", max_new_tokens=2)
            return old_holder, new_holder, refusal, served
        finally:
            await client.close()

    old_holder, new_holder, refusal, served = run(scenario())
    assert old_holder is None and new_holder == "new"
    assert refusal.code == "schema_version" and f"schema version {OLD}" in refusal.message
    assert "\n" not in refusal.message
    assert served.token_ids
    broker = services[0]
    refused = [e for e in broker.events("event_refused") if e.get("reason") == "schema_version"]
    assert {e["kind"] for e in refused} <= {"cache.available", "cache.heartbeat"} and refused
    assert len(refused) < 10, "one log line an interval, not one per message"
