"""The connector's settings as an operator writes them, and the paged-cache checks that run
before any write (vLLM's kernels themselves are exercised by the system test)."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.engines.settings import EngineSettings
from droidmesh.shared.engines.vllm import pages
from droidmesh.shared.errors import ConfigError


def _raw(tmp_path, **over):
    (tmp_path / "base").mkdir(exist_ok=True)
    (tmp_path / "qa").mkdir(exist_ok=True)
    return {"nats_url": "nats://127.0.0.1:4222", "models": {"base": str(tmp_path / "base"), "qa": str(tmp_path / "qa")},
            "base_model": "base", **over}


def test_settings_from_the_engines_dict(tmp_path):
    s = EngineSettings.from_mapping(_raw(tmp_path, reuse_timeout_s=3, transport="shm"))
    assert s.reuse_timeout_s == 3.0 and isinstance(s.reuse_timeout_s, float) and s.transport == "shm"
    assert s.model_for(None) == "base" and s.model_for("qa") == "qa" and s.model_for("other") is None


@pytest.mark.parametrize(("over", "message"), [
    ({"nats_urll": "x"}, "unknown DroidMesh connector settings"),
    ({"reuse_timeout_s": "10"}, "str where float"),
    ({"kv_screen": 1}, "int where bool"),
    ({"base_model": "nobody"}, "must be one of models"),
    ({"transport": "carrier-pigeon"}, "transport"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"models": {"base": "/does/not/exist"}}, "is not a directory"),
    ({"hold": True}, "holder_id"),
    ({"hold_e_layers": ["6"]}, "str where int"),
    ({"store_bytes": True}, "bool where int"),
])
def test_bad_settings_are_one_line_errors(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        EngineSettings.from_mapping(_raw(tmp_path, **over))


def test_holding_settings_from_json_lists(tmp_path):
    s = EngineSettings.from_mapping(_raw(tmp_path, hold=True, holder_id="vllm-base", hold_e_layers=[6],
                                         readers=["qa"], store_bytes=1 << 20))
    assert (s.hold, s.holder_id, s.hold_e_layers, s.readers, s.store_bytes) == (True, "vllm-base", (6,), ("qa",), 1 << 20)


def test_layer_names_and_slots():
    assert pages.layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError):
        pages.layer_index("lm_head")
    assert pages.slots_of([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError):
        pages.slots_of([3], 4, 5)


@pytest.mark.parametrize(("k_shape", "slots", "message"), [
    ((1, 2, 3, 8), [0, 1, 2], "do not fit"),  # 2 heads for a cache of 3
    ((1, 3, 3, 4), [0, 1, 2], "do not fit"),  # head_dim 4 for 8
    ((1, 3, 2, 8), [0, 1, 2], "tokens for"),
    ((1, 3, 3, 8), [0, 1, 64], "outside the cache"),  # 4 blocks of 16 slots
    ((1, 3, 3, 8), [-1, 1, 2], "outside the cache"),
])
def test_a_write_that_does_not_fit_is_refused_before_the_cache_is_touched(k_shape, slots, message):
    cache = torch.zeros(4, 3, 16, 16)  # [blocks, kv_heads, block_size, 2 * head_dim]
    k = torch.ones(k_shape)
    with pytest.raises(ValueError, match=message):
        pages.write_layer(cache, k, k.clone(), torch.tensor(slots), "vec")
    assert not cache.any()
