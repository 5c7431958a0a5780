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
    assert torch.equal(got, want)
