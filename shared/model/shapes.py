"""Named model shapes for latency work without weights: real architectures' configs, random init.

`build(name, device, dtype)` makes the model directly on `device` in `dtype` (no CPU copy first:
an 8B model in float32 on the host would need 32 GB and minutes), seeded, so latency and memory
are those of the real architecture; quality is meaningless. `tiny` is the same code path at a
size a CPU test runs in seconds.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model import attention
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.device import resolve_device, resolve_dtype

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                                max_position_embeddings=131072)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                                 max_position_embeddings=131072)),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                                  max_position_embeddings=131072, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                                   max_position_embeddings=8192, tie_word_embeddings=True)),
    "tiny": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192)),
}


def build(name: str, device: str = "cpu", dtype: str | torch.dtype | None = None, seed: int = 0) -> ModelAdapter:
    """The named shape, random-initialised on `device` in `dtype` (default: the device's)."""
    if name not in SHAPES:
        raise BadRequestError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    family, config = SHAPES[name]
    dev = resolve_device(device)
    cfg = transformers.AutoConfig.for_model(family, **config)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.NAME, dtype=resolve_dtype(dtype, dev))
    return ModelAdapter(model=model.eval(), tokenizer=None, name=f"shape-{name}")


def weights_bytes(model: ModelAdapter) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


def kv_bytes(model: ModelAdapter, tokens: int) -> int:
    """K and V of every layer for `tokens` tokens, in the model's dtype."""
    fp = model.fingerprint
    return 2 * model.num_layers * fp.num_kv_heads * fp.head_dim * tokens * model.dtype.itemsize
