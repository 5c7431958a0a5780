"""The receiver's translators: 'FILE@SHA256' entries, loaded hash-checked at start, a refused one
kept as a reason instead of failing the process."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.pipeline import align_target, load_translators
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.kv.translate import Translator
from droidmesh.shared.mesh.maps_store import InMemoryMapsStore
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.model.text import context_spans, tokenizer_spec
from droidmesh.shared.zoo.tokenizer import hf_tokenizer
from tests.conftest import FAMILIES


@pytest.fixture(scope="module")
def model():
    """A receiver model with a fast tokenizer (the split vocabulary)."""
    m = random_model("llama", seed=0, name="m", **FAMILIES["llama"])
    return ModelAdapter(model=m.model, tokenizer=hf_tokenizer("split"), name="m")


@pytest.fixture()
def published(tmp_path, model):
    """(file, sha256) of an identity translator that keeps the zoo tokenizer as its source's."""
    tr = Translator.identity(model, torch.zeros(model.num_layers, model.config.hidden_size), 1)
    tr = dataclasses.replace(tr, source_tokenizer=tokenizer_spec(hf_tokenizer("zoo")), target_sha256="ab" * 32)
    path = tmp_path / "m-to-m.safetensors"
    return path, tr.save(path)


def _load(entries, model, store=None, sha="ab" * 32):
    return asyncio.run(load_translators(entries, store or InMemoryMapsStore(), model, sha, 5.0))


@pytest.mark.parametrize("entry", ["t.safetensors", "t.safetensors@abc", "@" + "0" * 64, "t@" + "A" * 64])
def test_a_translator_entry_without_a_sha256_is_a_config_error(tiny_pair, entry):
    """Each entry must be FILE@ or nothing before 64 lowercase hex digits."""
    with pytest.raises(ConfigError, match="FILE@SHA256"):
        ReceiverConfig(model_path=str(tiny_pair[1]), translators=(entry,))


def test_translators_load_by_source_model_and_refused_ones_become_reasons(published, tmp_path, model):
    """The right hash loads (file or bucket) under its source model; another hash, a missing file or a
    hash the bucket lacks is one reason line each."""
    path, sha = published
    store = InMemoryMapsStore()
    assert asyncio.run(store.put(path.read_bytes())) == sha
    entries = (f"{path}@{sha}", f"{path}@{'0' * 64}", f"{tmp_path / 'none'}@{sha}", sha, "1" * 64)
    loaded, failures = _load(entries, model, store)
    assert list(loaded) == ["m"] and loaded["m"].translator.source_layers == list(range(6))
    assert len(failures) == 3 and failures[0].startswith("translator_mismatch: m-to-m.safetensors")
    assert "none" in failures[1] and failures[2].startswith("maps_not_found: 111111111111... (maps bucket)")


def test_a_translator_for_other_receiver_weights_or_another_architecture_is_refused(published, model):
    """Bound to other target weights, or to a target of another fingerprint: a reason, nothing loaded."""
    path, sha = published
    assert _load((f"{path}@{sha}",), model, sha="cd" * 32)[1][0].startswith("translator_mismatch")
    other = random_model("qwen2", seed=0, name="m", **FAMILIES["qwen2"])
    other = ModelAdapter(model=other.model, tokenizer=hf_tokenizer("split"), name="m")
    loaded, failures = _load((f"{path}@{sha}",), other)
    assert not loaded and "another target model" in failures[0]


def test_a_context_is_tokenized_for_both_models_and_aligned(published, model):
    """The source's ids come from the tokenizer inside the translator file, the receiver's from its own."""
    path, sha = published
    loaded, _ = _load((f"{path}@{sha}",), model)
    text = "doc north the old road"
    tok = align_target(hf_tokenizer("split"), text, *context_spans(loaded["m"].source_tokenizer, text))
    assert tok.source_ids == [1, *hf_tokenizer("zoo")("doc north the old road", add_special_tokens=False)["input_ids"]]
    assert len(tok.target_ids) == len(tok.spans) > len(tok.source_ids)
