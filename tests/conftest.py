"""Shared fixtures: tiny random-init models of two families (MHA Llama, GQA Qwen2)."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.model.adapter import ModelAdapter, random_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=97)
FAMILIES = {
    "llama": dict(TINY, num_key_value_heads=4),
    "qwen2": dict(TINY, num_key_value_heads=2),  # GQA, attention bias
}
ATOL = 1e-4  # float32 logits, max-abs-diff against the receiver's own full prefill


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def receiver(family: str) -> ModelAdapter:
    return random_model(family, seed=0, name="receiver", **FAMILIES[family])


def perturbed_copy(model: ModelAdapter, layers: range, scale: float = 0.05, seed: int = 1) -> ModelAdapter:
    """A sender equal to `model` except for noise added to the weights of `layers`."""
    sender = ModelAdapter(model=copy.deepcopy(model.model), tokenizer=None, name="sender")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            for p in sender.model.model.layers[layer].parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return sender


@pytest.fixture(scope="module")
def prompt() -> tuple[list[int], list[int]]:
    """(context ids, question ids)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 97, (48,), generator=g).tolist(), torch.randint(0, 97, (6,), generator=g).tolist()


def reference_logits(model: ModelAdapter, ids: list[int]) -> torch.Tensor:
    """The model's own HF forward over `ids` (no DroidMesh code on this path): [T, vocab]."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids])).logits[0].float()


def reference_greedy(model: ModelAdapter, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from the model's own HF forward with its own cache."""
    out: list[int] = []
    with torch.inference_mode():
        res = model.model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model.model(input_ids=torch.tensor([[tok]]), cache=res.cache, use_cache=True)
    return out
