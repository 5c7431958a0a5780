"""The sender's store: byte budget, LRU order, tensor lookup."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.model.adapter import random_model
from tests.conftest import FAMILIES

FP = random_model("llama", **FAMILIES["llama"]).fingerprint


def _ctx(tokens: int) -> CapturedContext:
    kv = tuple(KVBlock(l, torch.zeros(1, 1, tokens, 4), torch.zeros(1, 1, tokens, 4)) for l in range(2))
    return CapturedContext(tuple(range(tokens)), FP, "m", kv, {0: torch.zeros(1, tokens, 8)})


def test_budget_is_never_exceeded_and_lru_goes_first():
    """Puts past the budget evict least recently used contexts, never exceeding the budget."""
    one = _ctx(10).nbytes
    store = CacheStore(budget_bytes=3 * one)
    for cid in "abc":
        assert store.put(cid, _ctx(10)) == []
    store.get("a")  # a becomes most recent
    assert store.put("d", _ctx(10)) == ["b"]
    assert store.nbytes <= store.budget and store.ids() == ["c", "a", "d"]
    assert store.evictions == 1


def test_oversize_context_is_refused():
    """A context bigger than the whole budget is a BadRequestError, the store unchanged."""
    store = CacheStore(budget_bytes=100)
    with pytest.raises(BadRequestError, match="exceeds the store budget"):
        store.put("x", _ctx(10))
    assert store.ids() == [] and store.nbytes == 0


def test_tensor_lookup():
    """K, V and E are found by (context, layer, kind); anything else is None."""
    store = CacheStore(budget_bytes=1 << 20)
    store.put("a", _ctx(5))
    assert store.tensor("a", 1, "K").shape == (1, 1, 5, 4)
    assert store.tensor("a", 0, "E").shape == (1, 5, 8)
    assert store.tensor("a", 1, "E") is None
    assert store.tensor("a", 2, "K") is None
    assert store.tensor("zz", 0, "K") is None
    assert store.tensor("a", 0, "Q") is None


def _on_device(tokens: int) -> CapturedContext:
    """A context in device memory: the meta device stands in for a GPU's (no bytes, same accounting)."""
    kv = tuple(KVBlock(l, torch.empty(1, 1, tokens, 4, device="meta"), torch.empty(1, 1, tokens, 4, device="meta"))
               for l in range(2))
    return CapturedContext(tuple(range(tokens)), FP, "m", kv, {0: torch.empty(1, tokens, 8, device="meta")})


def _moved(c: CapturedContext) -> CapturedContext:
    return c.with_items([torch.zeros(t.shape) for t in c.items()])


def test_past_the_device_budget_the_least_recent_move_to_host_and_stay_served():
    """Device budget two contexts, store budget five: a third device context moves the least
    recently used one to host memory (kept, in its place in the recency order), evicting nothing;
    one a pull holds is not moved."""
    one = _ctx(10).nbytes
    store = CacheStore(budget_bytes=5 * one, device_budget_bytes=2 * one)
    for cid in "ab":
        store.put(cid, _on_device(10))
    store.get("a")  # b is now the least recent
    victims = store.device_victims(one)
    assert [cid for cid, _ in victims] == ["b"]
    assert store.move("b", victims[0][1], _moved(victims[0][1]))
    assert store.put("c", _on_device(10)) == [] and store.ids() == ["b", "a", "c"]
    assert store.device_bytes == 2 * one and store.nbytes == 3 * one and store.moves == 1
    assert store.tensor("b", 0, "K").device.type == "cpu"  # served from host memory now
    hold = store.hold("a")
    assert [cid for cid, _ in store.device_victims(one)] == ["c"]  # a is held by a pull: not moved
    hold.release()


def test_a_move_of_a_context_that_changed_meanwhile_is_dropped():
    store = CacheStore(budget_bytes=1 << 20, device_budget_bytes=1)
    old = _on_device(10)
    store.put("a", old)
    store.put("a", _on_device(10))  # replaced while its copy was being made
    assert not store.move("a", old, _moved(old)) and store.moves == 0
    assert CacheStore(budget_bytes=1 << 20).device_victims(1 << 19) == []  # no device budget: nothing moves


def test_the_sender_moves_before_it_stores_and_counts_the_moves(monkeypatch):
    """The sender's path: the victims copied on its torch thread, swapped, counted in metrics."""
    import asyncio
    from types import SimpleNamespace

    from droidmesh.services.sender import handlers

    one = _ctx(10).nbytes
    store = CacheStore(budget_bytes=5 * one, device_budget_bytes=one)
    store.put("a", _on_device(10))
    moves = []
    s = SimpleNamespace(store=store, metrics=SimpleNamespace(tier_moves=SimpleNamespace(inc=lambda: moves.append(1))))

    async def run_torch(fn, *args):
        return fn(*args)

    s.run_torch = run_torch
    monkeypatch.setattr(handlers, "_to_host", lambda s, c: _moved(c))
    asyncio.run(handlers._make_room_on_device(s, _on_device(10)))
    assert moves == [1] and store.tensor("a", 0, "K").device.type == "cpu"
    asyncio.run(handlers._make_room_on_device(s, _ctx(10)))  # a host context needs no device room
    assert moves == [1]
