"""Translated KV (`shared/kv/translate.py`): alignment across tokenizers, the identity path's
exactness against full prefill, and the translator file's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from droidmesh.shared.errors import IntegrityError, MissingLayerError, ReuseError
from droidmesh.shared.kv import translate
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.kv.translate import TranslatedSource, Translator, TranslatorMismatchError, align
from droidmesh.shared.model.adapter import random_model
from droidmesh.shared.model.text import context_spans
from droidmesh.shared.zoo.tokenizer import hf_tokenizer
from tests.conftest import ATOL, FAMILIES

TEXT = "doc north the old road anna amber . busy market bruno basil . ask anna"


def test_align_maps_each_target_token_to_the_source_tokens_covering_its_characters():
    """Hand-built: a split word reads its one source token; a merged word reads both of its pieces."""
    #            "the"     " old"     " road"
    source = [None, (0, 3), (3, 7), (7, 12)]
    #            "th"    "e"     " ol"   "d"     " ro"   "ad"
    target = [None, (0, 2), (2, 3), (3, 6), (6, 7), (7, 10), (10, 12)]
    assert align(source, target) == [(0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]
    assert align(target, source) == [(0, 1), (1, 3), (3, 5), (5, 7)]


def test_align_reads_the_last_source_token_for_characters_no_source_token_covers():
    """A target token of bare whitespace reads the source token before it; specials pair by rank."""
    assert align([None, (0, 3), (4, 7)], [None, (0, 3), (3, 4), (4, 7)]) == [(0, 1), (1, 2), (1, 2), (2, 3)]
    with pytest.raises(ReuseError):
        align([(0, 3)], [None, (0, 3)])


def test_align_across_the_zoo_and_split_tokenizers_covers_the_text_in_order():
    """Every target token's source span covers its characters, spans never go backwards."""
    s_ids, s_spans = context_spans(hf_tokenizer("zoo"), TEXT)
    t_ids, t_spans = context_spans(hf_tokenizer("split"), TEXT)
    assert len(t_ids) > len(s_ids)  # filler words are two tokens in the split vocabulary
    spans = align(s_spans, t_spans)
    assert spans[0] == (0, 1)
    for (a, b), t in zip(spans[1:], t_spans[1:], strict=True):
        covered = (s_spans[a][0], s_spans[b - 1][1])
        assert covered[0] <= t[0] and t[1] <= covered[1]
    assert all(x[0] <= y[0] for x, y in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("plan", [ReusePlan.full_reuse(), ReusePlan.recompute(0, 2)], ids=lambda p: p.label())
def test_identity_translator_is_exact_against_full_prefill(family, plan):
    """source = target with identity maps: translated KV (and layer 0's E) give full prefill's logits and tokens."""
    model = random_model(family, seed=0, name="m", **FAMILIES[family])
    g = torch.Generator().manual_seed(3)
    ctx, q = torch.randint(3, 97, (40,), generator=g).tolist(), torch.randint(3, 97, (5,), generator=g).tolist()
    ctx = [1, *ctx]  # a start token at position 0
    captured = capture_prefill(model, ctx, e_layers=range(model.num_layers))
    with torch.inference_mode():
        start_x = torch.stack([model.attn_input(captured.e[l], l)[0, 0] for l in range(model.num_layers)])
    identity = Translator.identity(model, start_x, 1)
    source = TranslatedSource(CapturedSource(captured), identity, model, ctx, [(i, i + 1) for i in range(len(ctx))],
                              model.fingerprint)
    full = prefill(model, ctx + q, ReusePlan.full_prefill(), logits_for=len(q)).logits
    got = prefill(model, ctx + q, plan, source, logits_for=len(q)).logits
    assert (got - full).abs().max() <= ATOL
    assert generate(model, ctx + q, plan, source, max_new_tokens=6).tokens == \
        generate(model, ctx + q, ReusePlan.full_prefill(), max_new_tokens=6).tokens


@pytest.fixture()
def saved(tmp_path):
    model = random_model("llama", seed=0, name="m", **FAMILIES["llama"])
    tr = Translator.identity(model, torch.zeros(model.num_layers, model.config.hidden_size), 1)
    path = tmp_path / "m-to-m.translator"
    return model, path, tr.save(path)


def test_a_translator_with_the_published_hash_loads_and_one_with_another_is_refused(saved):
    """The right sha256 loads the same maps; a wrong hash or an altered byte is refused."""
    model, path, sha = saved
    tr = translate.load(path, sha)
    # bitwise: the identity map, saved and loaded: bytes
    assert tr.sources == tuple(range(model.num_layers)) and torch.equal(tr.w[0][128:192], torch.eye(64))
    with pytest.raises(TranslatorMismatchError):
        translate.load(path, "0" * 64)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(TranslatorMismatchError):
        translate.load(path, sha)


def test_a_translator_for_other_models_or_with_wrong_shapes_is_refused(saved, tmp_path):
    """Fingerprints other than the file's are refused; a file whose tensors disagree with its models is not loaded."""
    model, path, _ = saved
    other = random_model("qwen2", seed=0, name="o", **FAMILIES["qwen2"])
    tr = translate.load(path)
    with pytest.raises(TranslatorMismatchError):
        tr.check_models(model.fingerprint, other.fingerprint)
    bad = dataclasses.replace(tr, w=(torch.eye(64),) + tr.w[1:])
    bad.save(tmp_path / "bad.translator")
    with pytest.raises(IntegrityError):
        translate.load(tmp_path / "bad.translator")


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 8, b"\xff" * 16, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}xxxxxxxx"])
def test_bytes_that_are_not_a_translator_are_refused_in_one_error(garbage):
    """Truncated or foreign bytes raise IntegrityError, never something else."""
    with pytest.raises(IntegrityError):
        translate.from_bytes(garbage)


def test_a_translated_context_has_no_e_past_layer_0():
    """Recompute groups over a translated context start at layer 0: E of a later layer is refused, not guessed."""
    model = random_model("llama", seed=0, name="m", **FAMILIES["llama"])
    ctx = [1, *range(3, 20)]
    captured = capture_prefill(model, ctx, e_layers=range(model.num_layers))
    tr = Translator.identity(model, torch.zeros(model.num_layers, model.config.hidden_size), 1)
    source = TranslatedSource(CapturedSource(captured), tr, model, ctx, [(i, i + 1) for i in range(len(ctx))],
                              model.fingerprint)
    assert source.e(0, float("inf")).shape == (1, len(ctx), model.config.hidden_size)
    with pytest.raises(MissingLayerError):
        source.e(2, float("inf"))


def test_features_hold_each_tokens_row_and_the_previous_ones():
    """Per source layer [row t, row t-1], zeros before the first token, layers in the order given."""
    a, b = torch.arange(6.0).reshape(3, 2), 10 + torch.arange(6.0).reshape(3, 2)
    f = translate.features([a, b])
    assert f.shape == (3, 8)
    assert f[0].tolist() == [0, 1, 0, 0, 10, 11, 0, 0]
    assert f[2].tolist() == [4, 5, 2, 3, 14, 15, 12, 13]


def test_a_translator_with_a_shared_bottleneck_round_trips_and_translates(tmp_path):
    """Maps through a rank-r projection: the file keeps it, and the translated KV has the target's layout."""
    model = random_model("llama", seed=0, name="m", **FAMILIES["llama"])
    d, n, r = model.config.hidden_size, model.num_layers, 8
    g = torch.Generator().manual_seed(0)
    tr = dataclasses.replace(Translator.identity(model, torch.zeros(n, d), 1), sources=(0, 1),
                             proj=torch.randn(4 * d + 1, r, generator=g),
                             w=tuple(torch.randn(r, d, generator=g) for _ in range(1, n)))
    tr.save(tmp_path / "t.safetensors")
    back = translate.load(tmp_path / "t.safetensors")
    assert torch.equal(back.proj, tr.proj) and back.w[0].shape == (r, d)  # bitwise: saved and loaded bytes
    ctx = [1, *range(3, 20)]
    source = TranslatedSource(CapturedSource(capture_prefill(model, ctx, e_layers=(0, 1))), back, model, ctx,
                              [(i, i + 1) for i in range(len(ctx))], model.fingerprint)
    block = source.kv(3, float("inf"))
    assert tuple(block.k.shape) == model.kv_shape(len(ctx)) and torch.isfinite(block.v).all()
