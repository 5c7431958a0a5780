"""Soak (bounded): the sender's store stays within its byte budget while caches churn."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.service import SenderService
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.config_board import InMemoryConfigBoard
from droidmesh.shared.wire import schemas, subjects

pytestmark = pytest.mark.soak

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
SECONDS, MAX_CONTEXTS = 8.0, 400


def test_store_never_exceeds_budget_under_churn(tiny_pair, tiny_models):
    """Hundreds of distinct contexts (random lengths, some repeated) through a store that fits
    a few: after every request the store is within budget, and every eviction was announced."""
    budget = 600_000  # bytes: a handful of the tiny model's contexts

    async def run():
        bus = InProcessBus()
        evicted: list[str] = []

        async def on_evicted(data: bytes) -> None:
            evicted.append(schemas.decode(data, schemas.CacheEvicted).context_id)

        await bus.subscribe(f"{subjects.CACHE_EVICTED}.*", on_evicted)
        cfg = SenderConfig(model_path=str(tiny_pair[0]), model_id="sender", store_bytes=budget, e_layers=(0, 2))
        rng = random.Random(0)
        peak, n = 0, 0
        async with SenderService(cfg, bus=bus, model=tiny_models[0], board=InMemoryConfigBoard()) as svc:
            store = svc.state.store  # type: ignore[union-attr]  # state exists once the service is entered
            end = time.monotonic() + SECONDS
            recent: list[str] = []
            while time.monotonic() < end and n < MAX_CONTEXTS:
                if recent and rng.random() < 0.2:
                    ctx = rng.choice(recent)  # a hit: refreshes LRU order, no growth
                else:
                    ctx = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
                    recent = (recent + [ctx])[-5:]
                await bus.request(subjects.sender_prefill("sender"),
                                  schemas.encode(schemas.PrefillRequest(request_id=str(n), context=ctx)), 30)
                peak = max(peak, store.nbytes)
                assert store.nbytes <= budget
                n += 1
            await bus.settle()
            return n, peak, store.evictions, evicted

    n, peak, evictions, evicted = asyncio.run(run())
    assert n >= 50 and evictions > 0
    assert peak <= budget
    assert len(evicted) >= evictions  # each eviction published (shutdown withdrawals come on top)
