"""What reads a model's RoPE asks for it per layer, on the tiny Gemma 3 of `test_gemma3` (local
layers and global layers 2 and 5 rotate by different bases): the receiver's screen un-rotates
each layer's keys by that layer's RoPE, and SCD maps code each layer's keys under its own RoPE
(through the maps file too). Each of these refused the model before (`rope_tables()` without a
layer raises on it)."""

from __future__ import annotations

import hashlib

import torch

from droidmesh.shared.kv import scd
from droidmesh.shared.kv import screen as S
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import scd_fit
from tests.unit.kv.test_scd import RTOL, rel_err
from tests.unit.model.test_gemma3 import tiny_gemma3

LOCAL, GLOBAL = 0, 2


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_screen_unrotates_each_layers_keys_by_its_own_rope():
    """The reference mean of K equals the mean of the layer's own pre-RoPE keys (k_proj, then its
    k_norm) on a local and a global layer (float32: 1e-5 relative); the model's own cache passes."""
    model = tiny_gemma3()
    assert not torch.equal(model.rope_tables(LOCAL)[0], model.rope_tables(GLOBAL)[0])
    ids = _ids(0, 40)
    screen = S.Screen.build(model, ids)
    cap = capture_prefill(model, ids, e_layers=range(model.num_layers))
    hd = model.fingerprint.head_dim
    for layer in (LOCAL, GLOBAL):
        with torch.inference_mode():
            attn = model.model.model.layers[layer].self_attn
            x = model.attn_input(cap.e[layer], layer)  # [1, T, D]
            k_pre = attn.k_norm(attn.k_proj(x).view(1, x.shape[1], -1, hd)).transpose(1, 2)  # [1, kvh, T, hd]
        want = k_pre[0, :, 1:].float().mean(1).reshape(-1)  # [kvh * hd]
        got = screen.reference["K", layer].mean
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), layer
    readings = screen.check_many([("K", l, b.k) for l, b in enumerate(cap.kv)])
    assert all(abs(r.scale - 1) < 1e-5 for r in readings if r.scale is not None)
    assert all(abs(r.cosine - 1) < 1e-5 for r in readings if r.cosine is not None)


def test_scd_codes_each_layers_keys_under_its_own_rope():
    """A model calibrated against itself (ridge 0): every layer's full-rank K code reproduces its
    own K on a new context to RTOL, read back from the maps file too (the global layers' K codes
    carry their RoPE)."""
    model = tiny_gemma3()
    fits = scd_fit.calibrate(model, model, [_ids(s, 48) for s in (1, 2, 3)], ridge=0.0, progress=False,
                             kinds=("K", "V"))
    maps, data = scd_fit.maps_for(fits, ReusePlan.full_reuse(), share=1.0)
    back = scd.Maps.from_bytes(data, hashlib.sha256(data).hexdigest())
    cap = capture_prefill(model, _ids(4, 32), ())
    for m in (maps, back):
        for layer, block in enumerate(cap.kv):
            code = m.code(layer, "K")
            assert code is not None and code.rank == model.fingerprint.head_dim
            assert (code.rope is not None) == (model.windows[layer] is None), layer  # global layers only
            out = torch.empty_like(block.k)
            scd.decode(scd.encode(block.k, "K", code, m.rope), "K", code, m.rope, out)
            assert rel_err(out, block.k) < RTOL, layer
