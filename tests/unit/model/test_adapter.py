"""Loading local checkpoints: round trip, dtype, and clear errors (never the hub)."""

from __future__ import annotations

import json

import pytest
import torch

from shared.errors import BadRequestError, CheckpointNotFoundError, UnsupportedModelError
from shared.model.adapter import load_model, random_model
from tests.conftest import FAMILIES


def test_saved_checkpoint_loads_with_same_outputs(tmp_path, family):
    """A checkpoint saved to disk loads back with identical logits and fingerprint."""
    m = random_model(family, seed=0, **FAMILIES[family])
    m.model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.arange(10)[None]
    with torch.inference_mode():
        assert torch.equal(loaded.model(input_ids=ids).logits, m.model(input_ids=ids).logits)
    assert loaded.fingerprint == m.fingerprint and loaded.name == tmp_path.name


def test_dtype_is_applied(tmp_path):
    """dtype='bfloat16' loads bf16 weights; the engine reports it."""
    random_model("llama", **FAMILIES["llama"]).model.save_pretrained(tmp_path)
    assert load_model(tmp_path, dtype="bfloat16").dtype == torch.bfloat16


def test_missing_path_is_a_clear_error(tmp_path):
    """A path without a checkpoint raises CheckpointNotFoundError saying nothing is downloaded."""
    with pytest.raises(CheckpointNotFoundError, match="never downloads"):
        load_model(tmp_path / "meta-llama/Llama-3-8B")


def test_unknown_dtype_and_family_are_refused(tmp_path):
    """Unknown dtypes and unsupported model families raise specific errors."""
    random_model("llama", **FAMILIES["llama"]).model.save_pretrained(tmp_path)
    with pytest.raises(BadRequestError, match="unknown dtype"):
        load_model(tmp_path, dtype="float8")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(tmp_path)
