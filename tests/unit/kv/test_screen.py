"""The KV screen on the demo zoo's trained models: honest KV of every demo pair (a sender that is
another fine-tune of the receiver's base) passes; caches of zeros, sign-flipped or
random-at-the-right-scale K/V/E each fail with an IntegrityError. The screen only reads: a
screened reuse's logits equal the unscreened one's exactly; the un-rotated key mean equals the
mean of the model's own pre-RoPE keys (float32, relative 1e-5)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from droidmesh.shared.errors import CacheLayoutError, IntegrityError
from droidmesh.shared.kv import screen as S
from droidmesh.shared.kv.blocks import KVBlock
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.tasks.rows import encode_row
from droidmesh.shared.tasks.spec import TASKS
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.transport.inproc import CodedSource
from droidmesh.shared.transport.pull import pull_items
from droidmesh.shared.zoo.manifest import REPO_ZOO
from tests.system.garbage_sender import KINDS, garble

DEMO = REPO_ZOO / "demo"
PAIRS = [(p["sender"], p["receiver"], p["task"]) for p in json.loads((DEMO / "manifest.json").read_text())["pairs"]]
ROWS = 2  # test-split contexts per pair (~1K tokens each)
L = 12  # layers of every demo model
GROUP = (4, 6)  # the demo's restoring group for base -> qa: E of layer 4 is pulled


@pytest.fixture(scope="module")
def demo() -> dict[str, ModelAdapter]:
    return {name: load_model(DEMO / name, name=name) for name in sorted({m for p in PAIRS for m in p[:2]})}


@pytest.fixture(scope="module")
def screens(demo) -> dict[str, S.Screen]:
    built = {name: S.Screen.of_model(model) for name, model in demo.items()}
    assert all(s is not None for s in built.values())
    return built  # type: ignore[return-value]


@pytest.fixture(scope="module")
def captures(demo) -> dict[tuple[str, str], list[tuple[list[int], object]]]:
    """Per pair: (context ids, the sender's capture with E at every layer) for ROWS test rows."""
    out = {}
    for sender, receiver, task in PAIRS:
        rows = make_rows(task, "test", ROWS, SuiteShape())
        ctxs = [encode_row(demo[receiver].tokenizer, row, TASKS[task])[0] for row in rows]
        out[sender, receiver] = [(ctx, capture_prefill(demo[sender], ctx, e_layers=range(demo[sender].num_layers)))
                                 for ctx in ctxs]
    return out


def _tensors(cap):
    """Every (kind, layer, tensor) a pull could bring: K and V of each layer, E of layers >= 1."""
    for block in cap.kv:
        yield "K", block.layer, block.k
        yield "V", block.layer, block.v
    for layer, e in sorted(cap.e.items()):
        if layer > 0:
            yield "E", layer, e


def _expected(plan: ReusePlan):
    """(kind, layer) of what a pull for `plan` brings (as the receiver's pipeline passes it)."""
    return [(i.kind, i.layer) for i in pull_items(plan, L)]


def _screened(cap, screen, model, plan):
    return S.ScreenedSource(CapturedSource(cap), screen, model, _expected(plan), plan.patch)


@pytest.mark.parametrize("pair", [p[:2] for p in PAIRS], ids=lambda p: f"{p[0]}-to-{p[1]}")
def test_honest_kv_of_every_demo_pair_passes(screens, captures, pair):
    """Every K, V and E of the sender's captures of the pair's test contexts passes the receiver's
    per-tensor tests, every test applied (none skipped at ~1K tokens), and the direction test
    over all of them."""
    screen = screens[pair[1]]
    for _, cap in captures[pair]:
        cosines = []
        for kind, layer, t in _tensors(cap):
            r = screen.check(kind, layer, t)
            assert r.scale is not None and r.structure is not None and (r.cosine is not None) == (kind != "V")
            cosines += [r.cosine] if r.cosine is not None else []
        screen.check_direction(cosines)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_honest_kv_passes_after_a_lossy_codec(screens, captures, codec):
    """Quantized on the wire (decoded on arrival), honest KV and E still pass."""
    _, cap = captures["base", "qa"][0]
    src = CodedSource(cap, codec)
    cosines = []
    for layer in range(cap.num_layers):
        block = src.kv(layer, 0.0)
        cosines.append(screens["qa"].check("K", layer, block.k).cosine)
        screens["qa"].check("V", layer, block.v)
        if layer:
            cosines.append(screens["qa"].check("E", layer, src.e(layer, 0.0)).cosine)
    screens["qa"].check_direction(cosines)


@pytest.mark.parametrize("kind", ["zeros", "random"])
def test_zeros_and_noise_fail_every_tensor(screens, captures, kind):
    """All zeros (scale) and iid noise at the tensor's own rms (structure) fail at every layer,
    for K, V and E, on every pair."""
    for (_, receiver), caps in captures.items():
        _, cap = caps[0]
        for k, layer, t in _tensors(cap):
            with pytest.raises(IntegrityError, match=f"screen: {k} of layer {layer}: "):
                screens[receiver].check(k, layer, garble(t, kind, seed=layer))


def _garbled(cap, kind: str, layers, e: bool):
    kv = tuple(KVBlock(b.layer, garble(b.k, kind, 2 * b.layer), garble(b.v, kind, 2 * b.layer + 1))
               if b.layer in layers else b for b in cap.kv)
    return dataclasses.replace(cap, kv=kv, e={l: garble(t, kind, 99) for l, t in cap.e.items()} if e else cap.e)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("plan", [ReusePlan.recompute(*GROUP), ReusePlan.full_reuse(), ReusePlan.cacheblend(0.2)],
                         ids=lambda p: p.label())
def test_a_screened_reuse_of_garbage_is_an_integrity_error(demo, screens, captures, kind, plan):
    """Through the engine, every demo pair: a cache of garbage (every layer's K/V and E) makes the
    screened reuse raise IntegrityError (the caller falls back); zeros and noise fail at the
    first tensor read, sign-flipped at the direction test. Unscreened, the same cache passes the
    range checks (what the screen closes)."""
    for (_, receiver), caps in captures.items():
        ctx, cap = caps[0]
        bad = _garbled(cap, kind, range(L), e=True)
        prompt, model = ctx + [ctx[1]], demo[receiver]
        if receiver == "qa":
            prefill(model, prompt, plan, CapturedSource(bad))  # the range checks pass it
        match = "screen: direction: " if kind == "flipped" else "screen: (K|E) of layer "
        with pytest.raises(IntegrityError, match=match):
            prefill(model, prompt, plan, _screened(bad, screens[receiver], model, plan))


@pytest.mark.parametrize("kind", ["zeros", "random"])
@pytest.mark.parametrize("what", ["kv", "e"])
def test_one_garbage_tensor_is_enough(demo, screens, captures, kind, what):
    """Zeros or noise in one layer's K/V (layer 7), or in the group's E, among honest layers fails."""
    qa = demo["qa"]
    ctx, cap = captures["base", "qa"][0]
    plan = ReusePlan.recompute(*GROUP)
    if what == "kv":
        bad = _garbled(cap, kind, [7], e=False)
    else:
        bad = dataclasses.replace(cap, e={**cap.e, GROUP[0]: garble(cap.e[GROUP[0]], kind, 3)})
    with pytest.raises(IntegrityError, match=f"screen: {'K' if what == 'kv' else 'E'} of layer "):
        prefill(qa, ctx + [ctx[1]], plan, _screened(bad, screens["qa"], qa, plan))


def test_what_the_screen_does_not_detect(demo, screens, captures):
    """The documented limits: a sign flip confined to one layer's K/V, to E, or to V everywhere
    passes (the direction test judges the cache's K/E offsets as a whole, and leaves V out)."""
    qa = demo["qa"]
    ctx, cap = captures["base", "qa"][0]
    plan = ReusePlan.recompute(*GROUP)
    one_layer = _garbled(cap, "flipped", [7], e=False)
    e_only = dataclasses.replace(cap, e={l: -t for l, t in cap.e.items()})
    v_only = dataclasses.replace(cap, kv=tuple(KVBlock(b.layer, b.k, -b.v) for b in cap.kv))
    for bad in (one_layer, e_only, v_only):
        prefill(qa, ctx + [ctx[1]], plan, _screened(bad, screens["qa"], qa, plan))


def test_screening_changes_nothing_it_passes(demo, screens, captures):
    """A screened honest reuse gives exactly the unscreened logits (the screen only reads)."""
    qa = demo["qa"]
    ctx, cap = captures["summ", "qa"][0]
    prompt, plan = ctx + [ctx[1]], ReusePlan.recompute(*GROUP)
    plain = prefill(qa, prompt, plan, CapturedSource(cap))
    screened = prefill(qa, prompt, plan, _screened(cap, screens["qa"], qa, plan))
    assert torch.equal(plain.logits, screened.logits)  # bitwise: the same prefill; the screen only reads


def test_patch_inputs_are_screened_as_normalized_inputs(demo, screens, captures):
    """An SCD patch's E arrives as the layer's normalized attention input (kind X): the honest
    one passes, zeros and noise fail."""
    qa = demo["qa"]
    _, cap = captures["base", "qa"][0]
    with torch.inference_mode():
        x = qa.attn_input(cap.e[5], 5)  # [1, T, D]
    screens["qa"].check("X", 5, x)
    for kind in ("zeros", "random"):
        with pytest.raises(IntegrityError, match="screen: patch input of layer 5"):
            screens["qa"].check("X", 5, garble(x, kind))


def test_layout_and_range_failures_keep_their_own_reasons(demo, screens, captures):
    """The screen leaves a NaN and a wrong shape unjudged: the engine's own checks, right after
    the read, still say 'values out of range' and CacheLayoutError."""
    qa = demo["qa"]
    ctx, cap = captures["base", "qa"][0]
    plan = ReusePlan.recompute(*GROUP)
    v = cap.kv[3].v.clone()
    v[0, 0, 5, 1] = float("nan")
    nan = dataclasses.replace(cap, kv=tuple(KVBlock(3, b.k, v) if b.layer == 3 else b for b in cap.kv))
    with pytest.raises(IntegrityError, match="values out of range"):
        prefill(qa, ctx + [ctx[1]], plan, _screened(nan, screens["qa"], qa, plan))
    short = KVBlock(3, cap.kv[3].k[:, :, :-1], cap.kv[3].v)
    cut = dataclasses.replace(cap, kv=tuple(short if b.layer == 3 else b for b in cap.kv))
    with pytest.raises(CacheLayoutError):
        prefill(qa, ctx + [ctx[1]], plan, _screened(cut, screens["qa"], qa, plan))


def test_short_contexts_skip_only_the_structure_test(screens, demo):
    """With too few tokens to tell noise from an offset, the structure test is skipped: honest KV
    passes, zeros still fail (scale), a flipped cache still fails (direction)."""
    qa = demo["qa"]
    cap = capture_prefill(qa, qa.tokenizer("the old town has a small market")["input_ids"][:8])
    r = screens["qa"].read("K", 2, cap.kv[2].k)
    assert r.structure is None and r.failure() is None
    assert screens["qa"].read("K", 2, garble(cap.kv[2].k, "zeros")).failure() is not None
    with pytest.raises(IntegrityError, match="screen: direction"):
        screens["qa"].check_direction([screens["qa"].read("K", l, -b.k).cosine for l, b in enumerate(cap.kv)])


def test_unrotated_key_mean_matches_the_models_pre_rope_keys(demo, captures):
    """`stats` rotates keys back before averaging: its mean equals the mean of the layer's own
    k_proj output (before RoPE) over tokens 1..T-1."""
    qa = demo["qa"]
    _, cap = captures["base", "qa"][0]
    inv_freq, _ = qa.rope_tables()
    for layer in (0, 6, 11):
        with torch.inference_mode():
            x = qa.attn_input(cap.e[layer], layer)  # [1, T, D]
            attn = qa.model.model.layers[layer].self_attn
            k_pre = attn.k_proj(x).view(1, x.shape[1], -1, qa.fingerprint.head_dim).transpose(1, 2)  # [1, kvh, T, hd]
        want = k_pre[0, :, 1:].float().mean(1).reshape(-1)  # [kvh * hd]
        got = S.stats(cap.kv[layer].k, "K", inv_freq).mean
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


def test_keys_from_a_later_token_are_rotated_back_at_their_own_positions(demo, captures):
    """A sliding-window layer's K pulled from token `a` (positions a..T-1): `measure` with the
    tables from `a` gives the mean of the layer's pre-RoPE keys over tokens a+1..T-1."""
    qa = demo["qa"]
    _, cap = captures["base", "qa"][0]
    inv_freq, _ = qa.rope_tables()
    T = cap.tokens
    a = T - 257
    cos, sin = S.rope_tables(inv_freq, T, torch.device("cpu"))  # each [T, hd]
    for layer in (0, 6):
        with torch.inference_mode():
            x = qa.attn_input(cap.e[layer], layer)  # [1, T, D]
            attn = qa.model.model.layers[layer].self_attn
            k_pre = attn.k_proj(x).view(1, T, -1, qa.fingerprint.head_dim).transpose(1, 2)  # [1, kvh, T, hd]
        want = k_pre[0, :, a + 1:].float().mean(1).reshape(-1)  # [kvh * hd]
        _, got, n = S.measure(cap.kv[layer].k[:, :, a:], "K", (cos[a:], sin[a:]))
        assert n == T - a - 1
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


def test_a_pull_from_a_later_token_is_screened_on_the_tokens_pulled(demo, screens, captures):
    """`ScreenedSource(starts=...)`: what lies before a layer's start (zeros in the receiver's
    buffer, here loud noise) is not judged; what was pulled still is."""
    qa = demo["qa"]
    _, cap = captures["base", "qa"][0]
    a = cap.tokens - 300
    plan = ReusePlan.full_reuse()
    starts = {l: a for l in range(0, L, 2)}
    g = torch.Generator().manual_seed(3)

    def noisy(block: KVBlock, lo: int, hi: int) -> KVBlock:
        k, v = block.k.clone(), block.v.clone()
        k[:, :, lo:hi] = torch.randn(k[:, :, lo:hi].shape, generator=g) * 100
        v[:, :, lo:hi] = torch.randn(v[:, :, lo:hi].shape, generator=g) * 100
        return KVBlock(block.layer, k, v)

    before = dataclasses.replace(cap, kv=tuple(noisy(b, 0, a) if b.layer in starts else b for b in cap.kv))
    src = S.ScreenedSource(CapturedSource(before), screens["qa"], qa, _expected(plan), starts=starts)
    for layer in range(L):
        src.kv(layer, float("inf"))  # passes: the noise is where no query reads
    unscreened = S.ScreenedSource(CapturedSource(before), screens["qa"], qa, _expected(plan))
    with pytest.raises(IntegrityError, match="layer 0"):
        unscreened.kv(0, float("inf"))
    after = dataclasses.replace(cap, kv=tuple(noisy(b, a, cap.tokens) if b.layer == 2 else b for b in cap.kv))
    src = S.ScreenedSource(CapturedSource(after), screens["qa"], qa, _expected(plan), starts=starts)
    with pytest.raises(IntegrityError, match="layer 2"):
        src.kv(2, float("inf"))
