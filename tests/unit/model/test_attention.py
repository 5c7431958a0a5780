"""The engine's attention (fused SDPA, GQA in the kernel, causality from the lengths) against
transformers' eager attention with an explicit mask, float32, ATOL 1e-5."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.model import attention
from droidmesh.shared.model.adapter import random_model
from tests.conftest import FAMILIES

ATOL = 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("past,new", [(0, 12), (24, 6), (24, 1)], ids=["no past", "suffix over a cache", "one token"])
def test_matches_eager_attention_with_a_mask(family, past, new):
    """A context of `past` tokens in the cache, then `new` tokens through every layer: the same
    hidden states and cache contents as eager attention with the explicit causal mask."""
    ids = torch.randint(0, 97, (1, past + new), generator=torch.Generator().manual_seed(3))
    out = {}
    for impl in ("eager", attention.NAME):
        m = random_model(family, seed=0, attn_implementation=impl, **FAMILIES[family])
        with torch.inference_mode():
            cache = m.new_cache()
            if past:
                m.run_layers(m.embed(ids[:, :past]), 0, m.num_layers, cache, past=0)
            out[impl] = m.run_layers(m.embed(ids[:, past:]), 0, m.num_layers, cache, past=past)
    assert float((out["eager"] - out[attention.NAME]).abs().max()) <= ATOL


def test_an_explicit_mask_takes_transformers_own_path():
    """Token-level recompute passes a boolean visibility mask: the engine's attention hands it to
    transformers' sdpa unchanged (same result as calling that directly)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    m = random_model("qwen2", seed=0, **FAMILIES["qwen2"]).model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    mask = torch.rand(1, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True  # every query sees something
    got, _ = attention.attention(m, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.25)
    assert torch.equal(got, want)  # bitwise: the same call on the same inputs: handed on unchanged


@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (4, 4, None), (4, 1, 8)],
                         ids=["gqa", "mha", "mqa sliding"])
def test_one_reduced_precision_token_on_the_cpu_matches_float32_sdpa(heads, kv_heads, window):
    """A bfloat16 decode query (two matmuls and a float32 softmax, not the fused CPU kernel) over
    a cache slice (keys strided like a write-once cache's prefix): within 2e-2 of float32 SDPA
    over the same values (bfloat16 keeps 8 bits of mantissa; outputs are ~N(0, 1/keys))."""
    m = random_model("qwen2", seed=0, **FAMILIES["qwen2"]).model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    keys, hd = 37, 16
    buf_k, buf_v = torch.randn(2, kv_heads, 64, hd, generator=g), torch.randn(2, kv_heads, 64, hd, generator=g)
    q = torch.randn(2, heads, 1, hd, generator=g) * 2
    k, v = buf_k[:, :, :keys], buf_v[:, :, :keys]  # [2, kvH, 37, hd] views of a longer buffer
    kw = {"sliding_window": window} if window else {}
    got, _ = attention.attention(m, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.3, **kw)
    seen = slice(keys - window, keys) if window else slice(0, keys)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16().float(), k[:, :, seen].bfloat16().float(), v[:, :, seen].bfloat16().float(), scale=0.3,
        enable_gqa=heads != kv_heads).transpose(1, 2)  # [2, 1, H, hd]
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1, heads, hd)
    assert float((got.float() - want).abs().max()) <= 2e-2


def test_one_reduced_precision_token_does_not_take_the_fused_cpu_kernel(monkeypatch):
    """The fused kernel is what made a bfloat16 decode step slow on the CPU: one query must not reach it."""
    m = random_model("qwen2", seed=0, **FAMILIES["qwen2"]).model.model.layers[0].self_attn

    def refuse(*a, **kw):
        raise AssertionError("fused SDPA called for one bfloat16 query")

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", refuse)
    q, k = torch.randn(1, 4, 1, 16).bfloat16(), torch.randn(1, 2, 10, 16).bfloat16()
    out, _ = attention.attention(m, q, k, k, None, scaling=0.25)
    assert out.shape == (1, 1, 4, 16)
