"""`hf_cache.WriteOnceLayer`: K/V written in place into preallocated storage, grown when it must be."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.model.hf_cache import WriteOnceLayer


def _kv(n: int, start: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(n * 2 * 4, dtype=torch.float32).reshape(1, 2, n, 4) + start  # [1, kvh, n, hd]
    return k, -k


def test_updates_append_in_place_and_return_views_of_what_is_held():
    """Each update writes after what is held; keys / values are views of the first `length` tokens of one storage."""
    layer = WriteOnceLayer(capacity=10)
    k1, v1 = _kv(4)
    keys, values = layer.update(k1, v1)
    storage = keys.untyped_storage().data_ptr()
    k2, v2 = _kv(3, start=100)
    keys, values = layer.update(k2, v2)
    assert keys.untyped_storage().data_ptr() == storage and layer.get_seq_length() == 7
    # bitwise: copied into the cache's storage
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))
    assert torch.equal(layer.keys, keys)  # bitwise: the same storage


def test_an_update_past_the_capacity_grows_and_keeps_every_token():
    """A wrong capacity estimate costs one reallocation, never a token."""
    layer = WriteOnceLayer(capacity=2)
    k1, v1 = _kv(2)
    layer.update(k1, v1)
    k2, v2 = _kv(5, start=50)
    keys, values = layer.update(k2, v2)
    assert layer.get_seq_length() == 7 and keys.untyped_storage().nbytes() >= 7 * 2 * 4 * 4
    # bitwise: copied into the cache's storage
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))


def test_reset_and_crop_forget_tokens():
    """reset empties the layer; crop(-n) drops the last n tokens."""
    layer = WriteOnceLayer(capacity=8)
    layer.update(*_kv(5))
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.keys.shape[2] == 3
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized


def test_batch_reshaping_is_refused():
    """A write-once cache holds one sequence: beam-style batch edits are refused, not silently wrong."""
    layer = WriteOnceLayer(capacity=4)
    layer.update(*_kv(2))
    with pytest.raises(UnsupportedModelError):
        layer.batch_repeat_interleave(2)
