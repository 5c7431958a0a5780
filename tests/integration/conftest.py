"""Tiny random-init checkpoints on disk (with the zoo tokenizer) for in-process wiring tests."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from shared.model.adapter import load_model, random_model
from shared.zoo.tokenizer import hf_tokenizer


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sender dir, receiver dir): one random Llama, the sender perturbed in layers 2..3."""
    tok = hf_tokenizer()
    root = tmp_path_factory.mktemp("ckpt")
    recv = random_model("llama", seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                        max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    send = copy.deepcopy(recv.model)
    with torch.no_grad():
        for layer in (2, 3):
            for p in send.model.layers[layer].parameters():
                p.add_(torch.randn_like(p) * 0.05)
    paths = root / "sender", root / "receiver"
    for model, path in ((send, paths[0]), (recv.model, paths[1])):
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return paths


@pytest.fixture(scope="session")
def tiny_models(tiny_pair):  # type: ignore[no-untyped-def]
    return load_model(tiny_pair[0], name="sender"), load_model(tiny_pair[1], name="receiver")
