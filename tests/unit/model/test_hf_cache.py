"""`hf_cache`: a `WriteOnceLayer`'s K/V written in place into preallocated storage, grown when it must
be; a layer's K/V replaced whole on every transformers release the project allows."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.model.hf_cache import WriteOnceLayer, layer_kv, new_cache, set_layer_kv


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


@pytest.mark.parametrize("capacity", [None, 8], ids=["full-layer", "write-once"])
@pytest.mark.parametrize("reset", ["installed", "transformers-5.17"])
def test_setting_a_filled_layer_holds_exactly_the_new_kv(capacity, reset, monkeypatch):
    """`set_layer_kv` over a layer that already holds K/V (CacheBlend re-sets every layer) leaves
    only the new K/V, whatever transformers' `reset` means: in 5.17 a full layer's reset zeroes its
    tensors in place and stays initialised (an append after zeros, or a write-once layer with no
    storage), in later releases it drops them."""
    if reset == "transformers-5.17" and "reset" in vars(DynamicLayer):
        monkeypatch.delattr(DynamicLayer, "reset")  # the mixin's: zero in place, stay initialised
    from transformers import LlamaConfig

    cache = new_cache(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=8),
                      capacity)
    set_layer_kv(cache, 0, *_kv(5))
    k, v = _kv(3, start=100)
    set_layer_kv(cache, 0, k, v)
    keys, values = layer_kv(cache, 0)
    assert torch.equal(keys, k) and torch.equal(values, v)  # bitwise: copied into the cache's storage
    set_layer_kv(cache, 0, *_kv(2, start=7))  # and again, after a re-set
    assert layer_kv(cache, 0)[0].shape[2] == 2
