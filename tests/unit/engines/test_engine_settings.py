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
    assert s.device == "cpu" and EngineSettings.from_mapping(_raw(tmp_path, device="cuda:1")).device == "cuda:1"


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
    ({"device": "gpu"}, "device 'gpu': expected cpu, cuda or cuda:N"),
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


class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name


class _Layer:  # what the connector reads of vLLM's attention layer
    def __init__(self, backend: str, isa: str | None = None) -> None:
        self.attn_backend = _Backend(backend)
        if isa is not None:
            self.isa = isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("physical", ["logical", "token_major"])
def test_the_flash_layout_puts_each_tokens_k_then_v_where_the_gpu_kernels_read_them(dtype, physical):
    """FLASH_ATTN / TRITON_ATTN / FLEX_ATTENTION read a layer [blocks, H, bs, 2D] as
    `kv.transpose(1, 2).split(D, -1)`: token t's K for head h at [t // bs, t % bs, h, :D] of the
    transposed view, its V right after. Written through `write_layer` at shuffled blocks (a partial
    last one), every element lands there and `read_slots` returns it bit for bit, also when the
    tensor is stored token-major (vLLM's stride order on GPUs: a permuted view of the same shape)."""
    blocks, heads, bs, d, t = 6, 3, 16, 8, 37
    if physical == "token_major":  # storage [blocks, bs, H, 2D], seen as [blocks, H, bs, 2D]
        cache = torch.full((blocks, bs, heads, 2 * d), float("nan"), dtype=dtype).transpose(1, 2)
    else:
        cache = torch.full((blocks, heads, bs, 2 * d), float("nan"), dtype=dtype)
    slots = pages.slots_of([4, 0, 5], bs, t)
    k, v = torch.randn(1, heads, t, d).to(dtype), torch.randn(1, heads, t, d).to(dtype)
    pages.write_layer(cache, k, v, slots, pages.FLASH)
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)  # what the GPU kernels read
    for i in (0, 15, 16, 31, 32, 36):
        b, o = [4, 0, 5][i // bs], i % bs
        # bitwise: the write copies each token's bytes to its slot
        assert torch.equal(key_cache[b, o], k[0, :, i]) and torch.equal(value_cache[b, o], v[0, :, i])
    assert int(cache.isnan().sum()) == (blocks * bs - t) * heads * 2 * d  # nothing else written
    got_k, got_v = pages.read_slots(cache, slots, pages.FLASH)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)  # bitwise: read back by views, bytes copied


@pytest.mark.parametrize(("layer", "device", "layout"), [
    (_Layer("FLASH_ATTN"), "cpu", pages.FLASH),
    (_Layer("TRITON_ATTN"), "cpu", pages.FLASH),
    (_Layer("FLEX_ATTENTION"), "cpu", pages.FLASH),
    (_Layer("CPU_ATTN", isa="amx"), "cpu", "amx"),
    (_Layer("CPU_ATTN", isa="vec16"), "cpu", "vec16"),
])
def test_the_layout_is_the_layers_backends(layer, device, layout):
    assert pages.layout_of(layer, torch.zeros(2, 1, 16, 16, device=device), "auto") == layout


@pytest.mark.parametrize("layer", [_Layer("FLASHINFER"), _Layer("FLASHMLA"), _Layer("ROCM_ATTN")])
def test_a_backend_the_connector_does_not_write_is_refused_not_guessed(layer):
    """Another layout read as one of ours would hold (and serve) wrong K/V: refused, so the request
    falls back to vLLM's own prefill."""
    with pytest.raises(pages.UnsupportedLayout, match=f"backend {layer.attn_backend.name} .*CPU_ATTN"):
        pages.layout_of(layer, torch.zeros(2, 1, 16, 16), "auto")
    with pytest.raises(pages.UnsupportedLayout):
        pages.read_slots(torch.zeros(2, 1, 16, 16), torch.tensor([0]), "flashinfer")


@pytest.mark.parametrize(("cache_dtype", "model_dtype", "fits"), [
    ("auto", torch.bfloat16, True), (None, torch.float16, True),
    ("bfloat16", torch.bfloat16, True), ("float16", torch.float16, True),  # the model's own dtype, named
    ("bfloat16", torch.float16, False), ("float16", torch.bfloat16, False),  # a cast of every K/V
    ("fp8", torch.bfloat16, False), ("fp8_e5m2", torch.float16, False),  # quantized: its own layout and scales
])
def test_a_kv_cache_dtype_fits_when_it_is_the_models_own(cache_dtype, model_dtype, fits):
    assert pages.cache_dtype_fits(cache_dtype, model_dtype) is fits


@pytest.mark.gpu
def test_reading_a_layer_back_on_a_gpu_does_not_wait_for_the_device():
    """The held prompt's K/V are read once per layer: working out the blocks on the device (`unique`)
    would stop the host for every layer. Host slots in, no synchronisation, the same values out."""
    blocks, heads, bs, d, t = 6, 3, 16, 8, 37
    cache = torch.randn(blocks, heads, bs, 2 * d, device="cuda", dtype=torch.bfloat16)
    slots = pages.slots_of([4, 0, 5], bs, t)
    want_k, want_v = pages.read_slots(cache.cpu(), slots, pages.FLASH)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_k, got_v = pages.read_slots(cache, slots, pages.FLASH)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)  # bitwise: the same bytes, gathered
