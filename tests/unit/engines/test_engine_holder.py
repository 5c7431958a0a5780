"""An engine's prefills held as a sender holds its captures (`engines/holding.py`), over the
in-process bus and channel: what vLLM's save path hands over is announced with E computed here."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from droidmesh.shared.engines.holding import EngineHolder
from droidmesh.shared.engines.models import EngineModels
from droidmesh.shared.engines.settings import EngineSettings
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.model import text
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.hashing import held_context_id
from tests.numeric import assert_close_computed


def test_what_the_engine_prefilled_is_held_with_e_and_announced(tiny_pair, tiny_models):
    """`hold` returns at once; the context is then stored under the connector's scope, announced
    (token ids, E layer 2 as configured, the model id it was served as), its K/V the engine's and
    its E within the computed tolerance of a capturing prefill's; a repeat holds nothing new."""
    model = tiny_models[0]
    cfg = EngineSettings.from_mapping({"nats_url": "nats://127.0.0.1:4222", "models": {"base": str(tiny_pair[0])},
                                       "base_model": "base", "hold": True, "holder_id": "engine-1",
                                       "hold_e_layers": [2], "transport": "inproc", "scope": "team-a"})
    ids = text.prompt_ids(model.tokenizer, "an engine's prefill, held for others " * 8, "")[0]
    ref = capture_prefill(model, ids, (2,))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    heard: list[schemas.CacheAvailable] = []

    async def start() -> EngineHolder:
        bus = InProcessBus()

        async def on_available(data: bytes) -> None:
            heard.append(schemas.decode(data, schemas.CacheAvailable))

        await bus.subscribe(subjects.cache_available("engine-1"), on_available)
        holder = EngineHolder(cfg, bus, loop, EngineModels.of(dict.fromkeys(cfg.models, model)))
        await holder.start()
        return holder

    holder = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        for _ in range(2):
            assert holder.hold("base", ids, lambda: [(b.k, b.v) for b in ref.kv])
            deadline = time.monotonic() + 60
            while not heard and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.2)  # the repeat, had it been held again, would have been announced by now
    finally:
        asyncio.run_coroutine_threadsafe(holder.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    assert len(heard) == 1, heard
    (ev,) = heard
    assert (ev.model_id, ev.scope, ev.e_layers, list(ev.token_ids)) == ("base", "team-a", [2], ids)
    held = holder.store.get(held_context_id(ids, "team-a", weights_sha256(tiny_pair[0])))
    assert held is not None
    assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(held.kv, ref.kv, strict=True))  # bitwise: copies
    assert_close_computed(held.e[2], ref.e[2], dtype=model.dtype, layers=2, what="E_2")


def test_a_holder_busy_with_max_pending_holds_reads_nothing_more(tiny_pair, tiny_models):
    """With MAX_PENDING holds waiting for their E (here: a loop not yet running), the next hold is
    refused before its read: nothing is copied out of the engine's cache, and `hold` says False.
    Once the loop drains them (these are refused for their empty K/V), holds are taken again."""
    from droidmesh.shared.engines.holding import MAX_PENDING

    cfg = EngineSettings.from_mapping({"nats_url": "nats://127.0.0.1:4222", "models": {"base": str(tiny_pair[0])},
                                       "base_model": "base", "hold": True, "holder_id": "engine-1",
                                       "transport": "inproc"})
    loop = asyncio.new_event_loop()
    holder = EngineHolder(cfg, InProcessBus(), loop, EngineModels.of(dict.fromkeys(cfg.models, tiny_models[0])))
    reads: list[int] = []

    def read() -> list:
        reads.append(1)
        return []

    taken = [holder.hold("base", [1, 2, 3], read) for _ in range(MAX_PENDING + 1)]
    assert taken == [True] * MAX_PENDING + [False] and len(reads) == MAX_PENDING

    async def drained() -> None:  # the pending holds run: each refused, each released
        while holder._pending._value < MAX_PENDING:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)

    loop.run_until_complete(asyncio.wait_for(drained(), 60))
    assert holder.hold("base", [1, 2, 3], read) and len(reads) == MAX_PENDING + 1
    loop.run_until_complete(asyncio.wait_for(drained(), 60))
    loop.close()


def test_a_withdrawn_pair_is_unpaired_by_the_engines_holder(tiny_pair, tiny_models):
    """The engine's holder pairs a receiver model when a config naming its model comes, and unpairs
    it when that config is withdrawn with nothing left for the pair (its next grant is refused)."""
    model = tiny_models[0]
    sha = weights_sha256(tiny_pair[0])
    cfg = EngineSettings.from_mapping({"nats_url": "nats://127.0.0.1:4222", "models": {"base": str(tiny_pair[0])},
                                       "base_model": "base", "hold": True, "holder_id": "engine-1",
                                       "transport": "inproc"})
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), 2, 0.99)
    pair = schemas.RecomputeConfig(sender_model="base", receiver_model="docqa", sender_sha256=sha,
                                   receiver_sha256="b" * 64, profile_version=1, task="t", tolerance=0.05, chosen=point,
                                   frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6)

    async def go() -> tuple[bool, bool]:
        holder = EngineHolder(cfg, InProcessBus(), asyncio.get_running_loop(),
                              EngineModels.of(dict.fromkeys(cfg.models, model)))
        readers = holder.holder.models["base"].readers
        await holder._on_config(pair)
        paired = readers.allows("docqa")
        await holder._on_withdrawn(pair, [])
        return paired, readers.allows("docqa")

    assert asyncio.run(go()) == (True, False)
