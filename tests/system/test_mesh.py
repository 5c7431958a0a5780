"""The mesh as separate processes: real nats-server, UCX (or the same-host shm channel) between
sender and receiver."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.service.launch import start_service
from tests.system.conftest import until_indexed, words

pytestmark = pytest.mark.system

# Long enough that each per-layer transfer takes a measurable share of the pull.
CONTEXT = words(3000)
QUESTION = " what is gamma"
THREADS = {"OMP_NUM_THREADS": "1"}


def _start(services, nats_url, tiny_pair, group=(1, 2), receivers=1, transport="ucx"):
    services.append(start_service("cache_broker", {}, nats_url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 1, 2],
                                             "heartbeat_s": 0.5, "transport": transport}, nats_url, env=THREADS))
    for i in range(receivers):
        # the broker's answer decides the path: its deadline is pinned far above a busy host's
        # delays, so "partial" does not ride on a 0.5 s timer
        services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver",
                                                   "default_group": list(group), "transport": transport,
                                                   "lookup_timeout_s": 10.0}, nats_url,
                                      name=f"receiver{i}", env=THREADS))


async def _prefill_and_ask(url: str, model, n: int = 1, max_new_tokens: int = 6):
    client = await MeshClient.connect(url)
    try:
        await client.prefill("sender", CONTEXT)
        await until_indexed(client, model, CONTEXT)
        return await asyncio.gather(*(client.ask("receiver", CONTEXT, QUESTION, max_new_tokens=max_new_tokens)
                                      for _ in range(n)))
    finally:
        await client.close()


@pytest.mark.parametrize("transport", ["ucx", "shm"])
def test_answer_through_mesh_equals_engine(nats, services, tiny_pair, tiny_models, transport):
    """Separate processes + UCX or shm give the same tokens as the in-process engine, and the
    receiver started recomputing only once E had landed (that it need not wait for the reused KV is
    pinned deterministically by tests/unit/kv/test_late_arrival.py; a same-host pull can beat it)."""
    _start(services, nats[1], tiny_pair, group=(1, 2), transport=transport)
    (reply,) = asyncio.run(_prefill_and_ask(nats[1], tiny_models[1]))
    assert reply.path == "partial", reply
    sender_m, receiver_m = tiny_models
    ctx, q = text.prompt_ids(receiver_m.tokenizer, CONTEXT, QUESTION)
    ref = generate(receiver_m, ctx + q, ReusePlan.recompute(1, 2), CapturedSource(capture_prefill(sender_m, ctx, [1])),
                   max_new_tokens=6, eos_token_id=receiver_m.tokenizer.eos_token_id)
    assert reply.token_ids == ref.tokens
    st = reply.stages_ms
    assert st["arrived_e1"] <= st["recompute_start"], st


def test_two_receiver_copies_share_the_queue_group(nats, services, tiny_pair, tiny_models):
    """Requests to one model spread over both receiver copies on its queue group."""
    _start(services, nats[1], tiny_pair, receivers=2)
    replies = asyncio.run(_prefill_and_ask(nats[1], tiny_models[1], n=12, max_new_tokens=2))
    assert {r.path for r in replies} == {"partial"}, [(r.path, r.fallback_reason) for r in replies]
    assert len({r.served_by for r in replies}) == 2
