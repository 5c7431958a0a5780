"""Gemma 3 in the engine, on a tiny random config: the exactness tests of `tests/unit/kv` (the
Llama family's, same ATOL) run on it, plus what is Gemma's own: interleaved sliding-window and
global layers (a window of 8 under a 54-token prompt, so the window decides what a sliding layer
sees), per-layer-type RoPE, q/k norms, `query_pre_attn_scalar`, the scaled embedding, the
(1 + w) RMSNorm, tied embeddings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.kv import translate
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model import attention
from droidmesh.shared.model.adapter import ModelAdapter, load_model, random_model
from tests.conftest import ATOL, FAMILIES, reference_logits
from tests.unit.kv import test_oracle, test_partial

WINDOW = 8
KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # global layers 2 and 5
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=KINDS, vocab_size=97,
              max_position_embeddings=512)


def tiny_gemma3(seed: int = 0, attn_implementation: str = attention.NAME, **change) -> ModelAdapter:
    """A random Gemma 3 whose norms are random too (their init is all zeros, i.e. the identity
    scale: random ones make q/k norms and the (1 + w) form matter)."""
    m = random_model("gemma3_text", seed=seed, attn_implementation=attn_implementation, name="receiver",
                     **dict(GEMMA3, **change))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in m.model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.fixture(scope="module")
def receiver() -> ModelAdapter:
    return tiny_gemma3()


# The Llama family's exactness tests, run here on `receiver` above (6 layers, like theirs).
test_full_prefill_matches_hf_forward = test_partial.test_full_prefill_matches_hf_forward
test_logits_are_computed_for_the_positions_asked_only = test_partial.test_logits_are_computed_for_the_positions_asked_only
test_group_covering_all_layers_is_full_prefill = test_partial.test_group_covering_all_layers_is_full_prefill
test_self_reuse_every_group_is_exact = test_partial.test_self_reuse_every_group_is_exact
test_self_reuse_baselines_are_exact = test_partial.test_self_reuse_baselines_are_exact
test_cacheblend_full_ratio_recovers_a_different_sender = test_partial.test_cacheblend_full_ratio_recovers_a_different_sender
test_cached_context_is_a_prefix_of_the_prompt = test_partial.test_cached_context_is_a_prefix_of_the_prompt
test_every_layer_is_written_once = test_partial.test_every_layer_is_written_once_into_storage_sized_for_prompt_and_decode
test_write_once_generation_equals_the_reference = test_partial.test_write_once_generation_equals_the_reference
test_group_is_exact_iff_it_starts_by_a_and_ends_at_L = test_oracle.test_group_is_exact_iff_it_starts_by_a_and_ends_at_L
test_group_from_layer_zero_uses_the_receivers_own_embeddings = \
    test_oracle.test_group_from_layer_zero_uses_the_receivers_own_embeddings
test_swap_probe_is_exact_iff_the_swapped_layer_is_below_a = test_oracle.test_swap_probe_is_exact_iff_the_swapped_layer_is_below_a


def test_the_prompt_is_longer_than_the_window_and_the_window_matters(receiver, prompt):
    """The shared prompt spans several windows, and the same weights with a window wider than it
    answer differently: the tests above see what the sliding layers mask."""
    ctx, q = prompt
    assert len(ctx) > 4 * WINDOW
    wide = tiny_gemma3(sliding_window=1024)
    assert float((reference_logits(wide, ctx + q) - reference_logits(receiver, ctx + q)).abs().max()) > 100 * ATOL


def test_the_reference_forward_equals_transformers_eager_one(receiver, prompt):
    """The reference of the tests above is the model's own forward through the engine's kernel
    (transformers builds no mask for a registered kernel: the kernel applies the window); it
    equals transformers' eager forward with transformers' own sliding-window masks."""
    ctx, q = prompt
    eager = reference_logits(tiny_gemma3(attn_implementation="eager"), ctx + q)
    assert float((reference_logits(receiver, ctx + q) - eager).abs().max()) <= ATOL


@pytest.mark.parametrize("impl", [attention.NAME, "sdpa", "eager"])
@pytest.mark.parametrize("past,new", [(0, 30), (24, 6), (24, 1), (5, 2), (40, 14)],
                         ids=["no past", "suffix over a cache", "one token", "within the window", "wide suffix"])
def test_every_attention_implementation_matches_the_eager_forward(impl, past, new):
    """A context of `past` tokens in the cache, then `new` tokens through every layer: the logits of
    transformers' eager forward over all of them (its own masks), for the engine's kernel (window
    from the lengths) and for transformers' sdpa and eager (the adapter's window masks)."""
    m = tiny_gemma3(attn_implementation=impl)
    ids = torch.randint(0, 97, (1, past + new), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = m.new_cache(past + new)
        if past:
            m.run_layers(m.embed(ids[:, :past]), 0, m.num_layers, cache, past=0)
        got = m.logits(m.run_layers(m.embed(ids[:, past:]), 0, m.num_layers, cache, past=past))[0]  # [new, vocab]
    want = reference_logits(tiny_gemma3(attn_implementation="eager"), ids[0].tolist())[past:]
    assert float((got - want).abs().max()) <= ATOL


def test_sliding_layers_keep_every_token_in_the_cache(receiver, prompt):
    """What the cache holds: every layer, sliding or global, keeps the K/V of every token, so a
    pull moves all of them (the window is applied by the mask, not by dropping tokens)."""
    ctx, _ = prompt
    cap = capture_prefill(receiver, ctx)
    assert receiver.windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None)
    assert all(tuple(b.k.shape) == receiver.kv_shape(len(ctx)) for b in cap.kv)


def test_project_kv_gives_each_layers_own_kv(receiver, prompt):
    """The SCD patch's projection (k norm, the layer type's RoPE) reproduces every layer's cached K/V."""
    ctx, _ = prompt
    cap = capture_prefill(receiver, ctx, e_layers=range(receiver.num_layers))
    with torch.inference_mode():
        for l in range(receiver.num_layers):
            k, v = receiver.project_kv(receiver.attn_input(cap.e[l], l), l)  # each [1, kvh, T, hd]
            assert float((k - cap.kv[l].k).abs().max()) <= 1e-5 and float((v - cap.kv[l].v).abs().max()) <= 1e-5


def test_attn_norm_is_the_norm_attn_input_applies(receiver):
    """(weight, eps) reproduce the layer's input norm in the plain `weight * x / rms(x)` form
    (Gemma stores the weight as an offset from 1)."""
    h = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    for l in range(receiver.num_layers):
        w, eps = receiver.attn_norm(l)
        assert torch.allclose(translate.rms_norm(h, w, eps), receiver.attn_input(h, l), atol=1e-6)


def test_rope_tables_are_per_layer_type(receiver):
    """Sliding and global layers rotate by different bases: the tables are asked for per layer."""
    local, _ = receiver.rope_tables(0)
    glob, _ = receiver.rope_tables(2)
    # bitwise: one table function, one base, one shape
    assert not torch.equal(local, glob) and torch.equal(local, receiver.rope_tables(1)[0])
    with pytest.raises(UnsupportedModelError, match="per layer"):
        receiver.rope_tables()
    llama = random_model("llama", **FAMILIES["llama"])
    assert torch.equal(llama.rope_tables()[0], llama.rope_tables(3)[0])  # bitwise: one table function, one base, one shape


def test_the_fingerprint_tells_the_layer_pattern_and_the_window():
    """Two Gemma 3s differing only in which layers slide, or in the window, cannot share KV."""
    base = tiny_gemma3().fingerprint
    assert "rope" in base.diff(tiny_gemma3(sliding_window=16).fingerprint)
    assert "rope" in base.diff(tiny_gemma3(layer_types=list(reversed(KINDS))).fingerprint)
    assert base == tiny_gemma3(seed=1).fingerprint


def test_identity_translator_into_gemma3_is_exact(receiver, prompt):
    """As a translation target: translated E (decoded by `attn_norm`'s weights, projected by
    `project_kv`) with identity maps gives full prefill's logits."""
    ctx, q = prompt
    captured = capture_prefill(receiver, ctx, e_layers=range(receiver.num_layers))
    with torch.inference_mode():
        start_x = torch.stack([receiver.attn_input(captured.e[l], l)[0, 0] for l in range(receiver.num_layers)])
    ident = translate.Translator.identity(receiver, start_x, ctx[0])
    source = translate.TranslatedSource(CapturedSource(captured), ident, receiver, ctx,
                                        [(i, i + 1) for i in range(len(ctx))], receiver.fingerprint)
    full = prefill(receiver, ctx + q, ReusePlan.full_prefill(), logits_for=len(q)).logits
    for plan in (ReusePlan.full_reuse(), ReusePlan.recompute(0, 2)):
        assert float((prefill(receiver, ctx + q, plan, source, logits_for=len(q)).logits - full).abs().max()) <= ATOL


def test_a_saved_gemma3_loads_with_tied_embeddings_and_the_same_outputs(tmp_path, receiver, prompt):
    """A checkpoint round trip: supported on load, the LM head is the embedding, logits equal."""
    receiver.model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    ctx, q = prompt
    # bitwise: the same weights (saved and loaded), kernels and shapes
    assert torch.equal(reference_logits(loaded, ctx + q), reference_logits(receiver, ctx + q))
    assert loaded.fingerprint == receiver.fingerprint


def test_decoding_past_the_window_equals_the_reference(receiver):
    """A short prompt decoded well past the window (the sliding layers' view moves each token)."""
    from tests.conftest import reference_greedy

    ids = [3, 14, 15, 92, 65]
    assert generate(receiver, ids, ReusePlan.full_prefill(), max_new_tokens=3 * WINDOW).tokens == \
        reference_greedy(receiver, ids, 3 * WINDOW)


@pytest.mark.parametrize("family,window_config", [
    ("mistral", dict(sliding_window=WINDOW)),  # every layer slides
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3)),  # layers 3.. slide
], ids=["mistral", "qwen2"])
def test_the_other_families_sliding_windows_are_exact_past_the_window(family, window_config, prompt):
    """The same cache and masks serve Mistral's and Qwen2's sliding windows: full prefill and full
    reuse equal transformers' eager forward on a prompt six windows long."""
    ctx, q = prompt
    config = dict(FAMILIES["qwen2"], **window_config)
    m = random_model(family, seed=0, **config)
    assert any(m.windows) and len(ctx) > WINDOW
    eager = reference_logits(random_model(family, seed=0, attn_implementation="eager", **config), ctx + q)[-len(q):]
    src = CapturedSource(capture_prefill(m, ctx))
    for plan in (ReusePlan.full_prefill(), ReusePlan.full_reuse()):
        assert float((prefill(m, ctx + q, plan, src, logits_for=len(q)).logits - eager).abs().max()) <= ATOL


@pytest.mark.parametrize("impl", [attention.NAME, "eager"])
@pytest.mark.parametrize("plan", [ReusePlan.full_reuse(), ReusePlan.recompute(1, 3)], ids=["full-reuse", "recompute-1-3"])
def test_sliding_layers_reused_from_their_window_only_are_exact(impl, plan, prompt):
    """What a pull leaves out (`ReusePlan.window_starts`: a reused sliding layer's K / V before
    the last W - 1 context tokens) is never read: garbage there changes no logit and no token,
    through the suffix and decoding well past the window, under either attention."""
    from droidmesh.shared.kv.blocks import KVBlock

    receiver = tiny_gemma3(attn_implementation=impl)
    ctx, q = prompt
    captured = capture_prefill(receiver, ctx, e_layers=plan.e_layers)
    starts = plan.window_starts(receiver.windows, len(ctx))
    assert starts and set(starts.values()) == {len(ctx) - WINDOW + 1}  # sliding reused layers only
    assert not set(starts) & set(plan.recomputed_layers(receiver.num_layers)) and 2 not in starts  # 2 is global
    g = torch.Generator().manual_seed(5)
    kv = []
    for b in captured.kv:
        a = starts.get(b.layer, 0)
        k, v = b.k.clone(), b.v.clone()
        k[:, :, :a] = torch.randn(k[:, :, :a].shape, generator=g) * 100  # [1, kvh, a, hd]: never pulled
        v[:, :, :a] = torch.randn(v[:, :, :a].shape, generator=g) * 100
        kv.append(KVBlock(b.layer, k, v))
    garbled = CapturedSource(dataclasses.replace(captured, kv=tuple(kv)))
    honest = CapturedSource(captured)
    want = prefill(receiver, ctx + q, plan, honest, logits_for=len(q)).logits
    # bitwise: the same kernels and shapes; a masked key weighs exactly 0, so garbage there moves no bit
    assert torch.equal(prefill(receiver, ctx + q, plan, garbled, logits_for=len(q)).logits, want)
    full = prefill(receiver, ctx + q, ReusePlan.full_prefill(), logits_for=len(q)).logits
    assert float((want - full).abs().max()) <= ATOL  # self-reuse: exact
    n = 3 * WINDOW
    assert generate(receiver, ctx + q, plan, garbled, max_new_tokens=n).tokens == \
        generate(receiver, ctx + q, plan, honest, max_new_tokens=n).tokens


def test_window_starts_are_for_reused_sliding_layers_past_the_window_only(receiver):
    windows = receiver.windows  # sliding 0, 1, 3, 4; global 2, 5
    assert ReusePlan.full_reuse().window_starts(windows, 20) == {0: 13, 1: 13, 3: 13, 4: 13}
    assert ReusePlan.recompute(0, 2).window_starts(windows, 20) == {3: 13, 4: 13}
    # the first suffix query (position T) sees keys T - W + 1..T: W - 1 context tokens
    assert ReusePlan.full_reuse().window_starts(windows, WINDOW - 1) == {}
    assert ReusePlan.full_reuse().window_starts(windows, WINDOW) == {l: 1 for l in (0, 1, 3, 4)}
    assert ReusePlan.cacheblend(0.5).window_starts(windows, 20) == {}  # context tokens are recomputed: all read
    assert ReusePlan.full_prefill().window_starts(windows, 20) == {}


def test_a_layer_whose_own_window_is_not_its_configs_is_refused():
    """What a pull leaves out of a sliding layer follows `windows`: a module applying another
    window would read the zeros in front of the pulled rows, so such a model is refused."""
    m = tiny_gemma3()
    m.model.model.layers[0].self_attn.sliding_window = WINDOW // 2
    with pytest.raises(UnsupportedModelError, match="layer 0 attends over a window of 4"):
        ModelAdapter(m.model, m.tokenizer, "receiver")
    m.model.model.layers[0].self_attn.sliding_window = WINDOW
    assert ModelAdapter(m.model, m.tokenizer, "receiver").windows == m.windows
