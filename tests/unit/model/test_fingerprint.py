"""Architecture fingerprints: stable ids, field-level diffs, tokenizer sensitivity."""

from __future__ import annotations

import dataclasses

import pytest

from droidmesh.shared.errors import IncompatibleModelsError
from droidmesh.shared.model.adapter import random_model
from droidmesh.shared.model.fingerprint import ArchFingerprint, fingerprint_of, require_compatible
from tests.conftest import FAMILIES


def test_weights_do_not_change_the_fingerprint(family):
    """Two seeds of one architecture share a fingerprint (weights are not part of it)."""
    a = random_model(family, seed=0, **FAMILIES[family])
    b = random_model(family, seed=1, **FAMILIES[family])
    assert a.fingerprint == b.fingerprint and a.fingerprint.id == b.fingerprint.id


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_key_value_heads": 1}, "num_kv_heads"),
        ({"hidden_size": 128}, "hidden_size"),
        ({"vocab_size": 98}, "vocab_hash"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope"),
    ],
)
def test_each_field_is_named_in_the_diff(change, field):
    """Changing one architectural setting is reported as exactly that field."""
    base = random_model("qwen2", **FAMILIES["qwen2"]).fingerprint
    other = random_model("qwen2", **dict(FAMILIES["qwen2"], **change)).fingerprint
    assert field in base.diff(other)
    with pytest.raises(IncompatibleModelsError, match=field):
        require_compatible(base, other)


def test_model_type_differs_between_families():
    """A Llama and a Qwen2 with the same sizes are not exchangeable."""
    a = random_model("llama", **FAMILIES["qwen2"]).fingerprint
    b = random_model("qwen2", **FAMILIES["qwen2"]).fingerprint
    assert "model_type" in a.diff(b)


def test_round_trip_through_dict():
    """to_dict / from_dict is lossless (the wire carries fingerprints as dicts)."""
    fp = random_model("llama", **FAMILIES["llama"]).fingerprint
    assert ArchFingerprint.from_dict(fp.to_dict()) == fp


def test_tokenizer_table_is_hashed():
    """Two tokenizers of one size but different tables give different vocab hashes."""

    class Tok:
        def __init__(self, vocab: dict[str, int]):
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    cfg = random_model("llama", **FAMILIES["llama"]).config
    a = fingerprint_of(cfg, Tok({"a": 0, "b": 1}))
    b = fingerprint_of(cfg, Tok({"a": 1, "b": 0}))
    assert dataclasses.asdict(a)["vocab_hash"] != dataclasses.asdict(b)["vocab_hash"]
