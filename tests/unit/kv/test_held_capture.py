"""A full prefill that keeps E (`keep_e`) computes what a plain one does, and `captured_of` takes
out of its serving cache exactly what a capturing prefill of the same prompt holds: a receiver's
held context is the same object a sender would have captured."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.capture import capture_prefill, captured_of
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model import text
from tests.numeric import assert_close_computed

PROMPT = "the held cache of a served prompt, word by word, " * 6


def _ids(model) -> list[int]:
    return text.prompt_ids(model.tokenizer, PROMPT, " and then?")[0]


@pytest.mark.parametrize("keep", [(), (0,), (2, 4), (0, 1, 5)])
def test_keeping_e_changes_nothing_the_prefill_computes(tiny_models, keep):
    model = tiny_models[1]
    ids = _ids(model)
    plain = prefill(model, ids, ReusePlan.full_prefill())
    kept = prefill(model, ids, ReusePlan.full_prefill(), keep_e=keep)
    # bitwise: the same prefill; keeping E only holds references
    assert torch.equal(plain.logits, kept.logits) and sorted(kept.e) == sorted(keep)


def test_captured_of_a_served_prefill_equals_a_capturing_prefill(tiny_models):
    """Bit for bit (the same operations ran), after decoding appended to the serving cache; and
    full reuse of it gives the full prefill's tokens."""
    model = tiny_models[1]
    ids = _ids(model)
    served = generate(model, ids, ReusePlan.full_prefill(), max_new_tokens=5, keep_e=(0, 3))
    held = captured_of(model, ids, served.prefill)
    ref = capture_prefill(model, ids, [0, 3])
    assert held.token_ids == ref.token_ids and sorted(held.e) == [0, 3]
    for a, b in zip(held.kv, ref.kv, strict=True):
        # bitwise: the same prefill ran; decoding only appended
        assert a.k.shape == b.k.shape == model.kv_shape(len(ids)) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert all(torch.equal(held.e[l], ref.e[l]) for l in (0, 3))  # bitwise: the same prefill ran
    again = generate(model, [*ids, 7, 8], ReusePlan.full_reuse(), CapturedSource(held), max_new_tokens=5)
    assert again.tokens == generate(model, [*ids, 7, 8], ReusePlan.full_prefill(), max_new_tokens=5).tokens


def test_only_a_full_prefill_is_held(tiny_models):
    sender, model = tiny_models
    ids = _ids(model)
    reused = prefill(model, ids, ReusePlan.full_reuse(), CapturedSource(capture_prefill(sender, ids)))
    with pytest.raises(BadRequestError, match="own KV"):
        captured_of(model, ids, reused)


def test_captured_of_a_full_reuse_of_its_own_prefix_is_its_cache_of_the_whole_prompt(tiny_models):
    """A prompt that shares a prefix with a held context of the same model: full reuse of it plus
    the computed suffix is that model's cache of the whole prompt (within `tests/numeric.py`'s
    tolerance of a capture of it, which runs the suffix at other shapes; E joined from the
    prefix's and the suffix's). A recomputed group is not held."""
    model = tiny_models[1]
    ids = _ids(model)
    held = capture_prefill(model, ids[:20], [0, 3])
    longer = [*ids[:20], *ids[25:40]]
    reused = generate(model, longer, ReusePlan.full_reuse(), CapturedSource(held), max_new_tokens=3, keep_e=(0, 3))
    assert reused.prefill.reused_tokens == 20 and reused.prefill.e[3].shape[1] == len(longer) - 20
    got, ref = captured_of(model, longer, reused.prefill, held), capture_prefill(model, longer, [0, 3])
    for a, b in zip(got.kv, ref.kv, strict=True):
        for x, y, kind in ((a.k, b.k, "K"), (a.v, b.v, "V")):
            assert_close_computed(x, y, dtype=model.dtype, layers=model.num_layers, what=f"layer {a.layer} {kind}")
    for l in (0, 3):
        assert_close_computed(got.e[l], ref.e[l], dtype=model.dtype, layers=model.num_layers, what=f"E {l}")
    grouped = prefill(model, longer, ReusePlan.recompute(1, 3), CapturedSource(capture_prefill(tiny_models[0], longer, [1])))
    with pytest.raises(BadRequestError, match="own KV"):
        captured_of(model, longer, grouped, held)


@pytest.mark.parametrize("e_layers", [(), (0,), (2,), (1, 4)])
def test_an_engines_kv_with_e_computed_here_is_a_capturing_prefills_context(tiny_models, e_layers):
    """Another engine's K/V (here a capture's, standing in for vLLM's) plus E computed from the
    layers below: every E within the computed tolerance of the capturing prefill's, the K/V its
    own, and a plan over it answers like one over the capture."""
    from droidmesh.shared.kv.capture import captured_from_engine

    model = tiny_models[1]
    ids = _ids(model)
    ref = capture_prefill(model, ids, e_layers)
    got = captured_from_engine(model, ids, [(b.k, b.v) for b in ref.kv], e_layers)
    assert sorted(got.e) == sorted(ref.e) and got.token_ids == ref.token_ids and got.fingerprint == ref.fingerprint
    for l, e in ref.e.items():
        assert_close_computed(got.e[l], e, dtype=model.dtype, layers=max(l, 1), what=f"E_{l}")
    for a, b in zip(got.kv, ref.kv, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)  # bitwise: copied, same dtype


def test_an_engines_kv_of_the_wrong_shape_or_layer_count_is_refused(tiny_models):
    from droidmesh.shared.kv.capture import captured_from_engine

    model = tiny_models[1]
    ids = _ids(model)
    kv = [(b.k, b.v) for b in capture_prefill(model, ids).kv]
    with pytest.raises(BadRequestError, match="layers"):
        captured_from_engine(model, ids, kv[:-1])
    with pytest.raises(BadRequestError, match="expected"):
        captured_from_engine(model, ids[:-1], kv)
    with pytest.raises(BadRequestError, match="outside"):
        captured_from_engine(model, ids, kv, [model.num_layers])
