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
