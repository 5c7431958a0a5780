"""Cache scopes through the wired mesh (in-process bus, real engine): a sender keeps one context
per scope and announces each with its scope, also when a broker asks again; a receiver reuses only
its request's scope and public contexts."""

from __future__ import annotations

import asyncio

from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.hashing import PUBLIC, tenant_scope
from tests.integration.test_mesh_inprocess import CONTEXT, QUESTION, _ask, mesh


def test_scoped_prefills_are_separate_contexts_reused_only_in_scope(tiny_pair, tiny_models):
    a, b = tenant_scope("a"), tenant_scope("b")

    async def run() -> tuple[list[str], dict[str, str], list[schemas.CacheAvailable]]:
        async with mesh(tiny_pair, tiny_models) as (bus, broker, sender, receiver):
            ids = []
            for scope in (a, b):
                pre = await _ask(bus, subjects.sender_prefill("sender"),
                                 schemas.PrefillRequest(request_id=f"p-{scope}", context=CONTEXT, scope=scope),
                                 schemas.PrefillReply)
                ids.append(pre.context_id)
            await bus.settle()
            assert len(broker.index) == 2
            paths = {}
            for scope in (a, "tenant:c", PUBLIC):
                reply = await _ask(bus, subjects.receiver_generate("receiver"),
                                   GenerateRequest(request_id=f"r-{scope}", context=CONTEXT, question=QUESTION,
                                                   max_new_tokens=2, scope=scope), schemas.GenerateReply)
                paths[scope] = (reply.path, reply.bytes_pulled, reply.reused_tokens)
            events: list[schemas.CacheAvailable] = []

            async def seen(data: bytes) -> None:
                ev = schemas.decode(data, schemas.CacheAvailable)
                if ev.model_id == "sender":  # the receiver re-announces what it holds of its own prefills too
                    events.append(ev)

            await bus.subscribe(subjects.CACHE_AVAILABLE_ALL, seen)
            await bus.publish(subjects.BROKER_HELLO, schemas.encode(schemas.BrokerHello(broker_id="again")))
            for _ in range(200):
                if len(events) == 2:
                    break
                await asyncio.sleep(0.01)
            return ids, paths, events

    ids, paths, events = asyncio.run(run())
    assert ids[0] != ids[1]
    assert paths[a][0] == "partial" and paths[a][1] > 0
    for scope in ("tenant:c", PUBLIC):
        assert paths[scope] == ("full_prefill", 0, 0), scope
    assert sorted((e.scope, e.context_id) for e in events) == sorted([(a, ids[0]), (b, ids[1])])
