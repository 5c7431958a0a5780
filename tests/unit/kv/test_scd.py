"""SCD codes (`shared/kv/scd.py`): exactness where it must be exact, the maps file's checks, and Patch."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from safetensors.torch import save as st_save

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv import scd
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.model.adapter import random_model
from droidmesh.shared.profiling import scd_fit
from tests.conftest import TINY

# float32 end to end (fit in float64, codes and decode in float32): the identity map at full
# rank reproduces a tensor to within this, relative to its largest value.
RTOL = 1e-4
ROPE = scd.Rope(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), 1.0)  # head_dim 8


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def identity_code(x: torch.Tensor) -> scd.LinearCode:
    """The full-rank, no-ridge fit of x -> x (x [H, N, d])."""
    m = scd.Moments()
    m.add(x, x)
    return m.fit(ridge=0.0).truncate(x.shape[-1])


def roundtrip(t: torch.Tensor, kind: str, code: scd.LinearCode, rope: scd.Rope) -> torch.Tensor:
    out = torch.empty_like(t)
    scd.decode(scd.encode(t, kind, code, rope), kind, code, rope, out)
    return out


@pytest.mark.parametrize("kind", ["K", "V"])
def test_full_rank_identity_is_exact_on_random_kv(kind):
    """rank = head_dim, ridge 0, x = y: decode(encode(kv)) == kv to RTOL (K through un-rotate / rotate)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, 2, 40, 8, generator=g)  # [1, H, T, hd]
    x = ROPE.unrotate(kv[0]) if kind == "K" else kv[0]
    assert rel_err(roundtrip(kv, kind, identity_code(x), ROPE), kv) < RTOL


def test_full_rank_identity_is_exact_on_real_kv():
    """Calibrated on a model paired with itself (ridge 0), every layer's full-rank K and V codes
    reproduce that model's own KV on a new context to RTOL."""
    model = random_model("llama", seed=0, **TINY, num_key_value_heads=4)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 97, (48,), generator=g).tolist() for _ in range(3)]
    fits = scd_fit.calibrate(model, model, contexts, ridge=0.0, progress=False)
    captured = capture_prefill(model, torch.randint(0, 97, (32,), generator=g).tolist(), range(model.num_layers))
    hd = model.fingerprint.head_dim
    for layer in range(model.num_layers):
        for kind in ("K", "V"):
            t = captured.kv[layer].k if kind == "K" else captured.kv[layer].v
            assert rel_err(roundtrip(t, kind, fits.fits[(layer, kind)].truncate(hd), fits.rope), t) < RTOL


def test_calibrating_kv_only_gives_the_same_kv_fits_and_refuses_patch_maps():
    """kinds=("K", "V") skips E (the hidden-size fits): K/V fits equal the full calibration's, and
    a patch plan's maps need the E fits it did not make."""
    from droidmesh.shared.kv.plan import ReusePlan

    model = random_model("llama", seed=0, **TINY, num_key_value_heads=4)
    g = torch.Generator().manual_seed(4)
    contexts = [torch.randint(0, 97, (24,), generator=g).tolist() for _ in range(2)]
    full = scd_fit.calibrate(model, model, contexts, progress=False)
    kv = scd_fit.calibrate(model, model, contexts, progress=False, kinds=("K", "V"))
    assert {k for _, k in kv.fits} == {"K", "V"} and {k for _, k in full.fits} == {"K", "V", "E"}
    for key, fit in kv.fits.items():
        torch.testing.assert_close(fit.coef, full.fits[key].coef)
    scd_fit.maps_for(kv, ReusePlan.recompute(0, 1), 0.9)
    with pytest.raises(ValueError, match="kinds including 'E'"):
        scd_fit.maps_for(kv, ReusePlan.full_reuse().patched([1]), 0.9, 0.99)
    with pytest.raises(ValueError, match="kinds"):
        scd_fit.calibrate(model, model, contexts, progress=False, kinds=("Q",))


def test_rope_unrotate_inverts_rotate():
    """Un-rotating a rotated tensor gives it back, attention scaling included."""
    x = torch.randn(2, 33, 8, generator=torch.Generator().manual_seed(2))
    for rope in (ROPE, scd.Rope(ROPE.inv_freq, 1.3)):
        torch.testing.assert_close(rope.unrotate(rope.rotate(x)), x, atol=1e-5, rtol=1e-5)


def test_rank_r_code_recovers_a_rank_r_map():
    """y = x @ A with A of rank r: the fitted variance lives in r directions (`rank_for` says r)
    and the rank-r code reproduces y to RTOL (ridge 0)."""
    g = torch.Generator().manual_seed(3)
    h, n, d, r = 2, 200, 8, 3
    a = torch.randn(h, d, r, generator=g) @ torch.randn(h, r, d, generator=g)  # [H, d, d], rank r
    x = torch.randn(h, n, d, generator=g)
    m = scd.Moments()
    m.add(x, x @ a)
    fit = m.fit(ridge=0.0)
    assert fit.rank_for(0.999999) == r
    code = fit.truncate(r)
    t = torch.randn(1, h, 16, d, generator=g)
    out = torch.empty_like(t)
    scd.decode(scd.encode(t, "V", code, ROPE), "V", code, ROPE, out)
    assert scd.encode(t, "V", code, ROPE).shape == (h, 16, r)
    assert rel_err(out[0], t[0] @ a) < RTOL


def sample_maps() -> scd.Maps:
    g = torch.Generator().manual_seed(4)
    k, v = (identity_code(torch.randn(2, 30, 8, generator=g)) for _ in range(2))
    e = identity_code(torch.randn(1, 30, 16, generator=g))
    return scd.Maps(codes={(1, "K"): k, (1, "V"): v, (2, "E"): e}, rope=ROPE, meta={"sender_sha256": "s"})


def named(data: bytes) -> tuple[bytes, str]:
    return data, hashlib.sha256(data).hexdigest()


def test_maps_file_round_trips():
    """to_bytes / from_bytes keep every code, the RoPE and the metadata, named by the file's sha256."""
    maps = sample_maps()
    data, sha = named(maps.to_bytes())
    back = scd.Maps.from_bytes(data, sha)
    assert back.sha256 == sha and back.meta["sender_sha256"] == "s" and back.ranks() == maps.ranks()
    assert torch.equal(back.rope.inv_freq, ROPE.inv_freq) and back.rope.scaling == ROPE.scaling  # bitwise: the file round trip copies bytes
    for key, c in maps.codes.items():
        for name in ("mu_in", "enc", "dec", "mu_out"):
            assert torch.equal(getattr(back.codes[key], name), getattr(c, name))  # bitwise: the file round trip copies bytes


def test_a_bad_maps_file_is_an_integrity_error():
    """Wrong sha256, truncated bytes, a NaN, an unexpected tensor: each refused by `from_bytes`."""
    maps = sample_maps()
    data, sha = named(maps.to_bytes())
    with pytest.raises(IntegrityError, match="hash"):
        scd.Maps.from_bytes(data, "0" * 64)
    with pytest.raises(IntegrityError, match="not a safetensors"):
        scd.Maps.from_bytes(*named(data[:-40]))
    nan = dict(maps.codes)
    nan[(1, "V")] = dataclasses.replace(nan[(1, "V")], dec=nan[(1, "V")].dec.clone().fill_(float("nan")))
    with pytest.raises(IntegrityError, match="non-finite"):
        scd.Maps.from_bytes(*named(dataclasses.replace(maps, codes=nan).to_bytes()))
    tensors = {"rope.inv_freq": ROPE.inv_freq, "1.V.mu_in": torch.zeros(1, 8), "1.X.enc": torch.zeros(1, 8, 2)}
    with pytest.raises(IntegrityError, match="unexpected tensor"):
        scd.Maps.from_bytes(*named(st_save(tensors, metadata={"format": scd.FORMAT})))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patch_of_the_true_input_is_the_layers_own_kv(family):
    """`project_kv` of a layer's true normalized input (`attn_input` of its own E) is that
    layer's own K and V from the prefill (Qwen3: through its per-head K norm too)."""
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = random_model(family, seed=0, **TINY, num_key_value_heads=2, **extra)
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    captured = capture_prefill(model, ids, range(model.num_layers))
    with torch.inference_mode():
        for layer in range(model.num_layers):
            k, v = model.project_kv(model.attn_input(captured.e[layer], layer), layer)
            torch.testing.assert_close(k, captured.kv[layer].k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, captured.kv[layer].v, atol=1e-5, rtol=1e-5)


def test_rope_tables_serve_many_threads_at_once():
    """Encodes run on worker threads beside the torch thread: the tables' cache (8 lengths, oldest
    evicted) is raced by lookups, stores and evictions and must never raise, nor give another
    length's tables."""
    import concurrent.futures

    rope = scd.Rope(inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)), scaling=1.0)

    def hammer(seed: int) -> int:
        wrong = 0
        for i in range(1500):
            n = 1 + (seed * 7 + i) % 24  # 24 lengths through an 8-entry cache: constant eviction
            cos, sin = rope.tables(n, torch.device("cpu"))
            wrong += cos.shape[0] != n or sin.shape[0] != n
        return wrong

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(hammer, range(8))) == 0
