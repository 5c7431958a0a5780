"""Loading local checkpoints: round trip, dtype, and clear errors (never the hub)."""

from __future__ import annotations

import json

import pytest
import torch

from droidmesh.shared.errors import CheckpointNotFoundError, ConfigError, UnsupportedModelError
from droidmesh.shared.model.adapter import load_model, random_model
from tests.conftest import FAMILIES


def test_saved_checkpoint_loads_with_same_outputs(tmp_path, family):
    """A checkpoint saved to disk loads back with identical logits and fingerprint."""
    m = random_model(family, seed=0, **FAMILIES[family])
    m.model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.arange(10)[None]
    with torch.inference_mode():
        # bitwise: the same weights (saved and loaded), kernels and shapes
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
    with pytest.raises(ConfigError, match="dtype 'float8'"):
        load_model(tmp_path, dtype="float8")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(tmp_path)


def test_dtype_follows_the_device_unless_given(tmp_path):
    """Without a dtype a CPU load is float32; an explicit dtype wins."""
    random_model("llama", dtype="bfloat16", **FAMILIES["llama"]).model.save_pretrained(tmp_path)
    assert load_model(tmp_path, device="cpu").dtype == torch.float32
    assert load_model(tmp_path, device="cpu", dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_config_error(tmp_path):
    """device='cuda' where CUDA is absent raises a one-line ConfigError naming the device, not a torch error."""
    random_model("llama", **FAMILIES["llama"]).model.save_pretrained(tmp_path)
    for load in (lambda: load_model(tmp_path, device="cuda"), lambda: random_model("llama", device="cuda:1")):
        with pytest.raises(ConfigError, match="device 'cuda(:1)?': CUDA is not available") as info:
            load()
        assert "\n" not in str(info.value)


def test_misspelt_device_is_refused_before_loading(tmp_path):
    """A device name that is not cpu/cuda/cuda:N is a ConfigError even for a missing checkpoint."""
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        load_model(tmp_path / "absent", device="gpu0")


def test_token_tensor_is_on_the_models_device():
    """Token ids become a [1, T] int64 tensor on the model's device."""
    m = random_model("llama", **FAMILIES["llama"])
    ids = m.token_tensor([5, 6, 7])
    assert ids.dtype == torch.long and ids.device == m.device and ids.tolist() == [[5, 6, 7]]
