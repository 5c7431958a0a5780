"""The `lowrank` codec: what it refuses, what travels raw, exact sizes, and out-of-range decodes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv import scd
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import random_model
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport import prepared as prepared_codes
from droidmesh.shared.transport.inproc import CodedSource
from droidmesh.shared.wire.schemas import CodecParams, TensorHeader
from tests.conftest import TINY

H, HD, T, R = 4, 16, 12, 3  # kv heads, head_dim, tokens, rank
ROPE = scd.Rope(1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD), 1.0)


def code(seed: int, scale: float = 1.0) -> scd.LinearCode:
    g = torch.Generator().manual_seed(seed)
    return scd.LinearCode(torch.randn(H, HD, generator=g), torch.randn(H, HD, R, generator=g),
                          torch.randn(H, R, HD, generator=g) * scale, torch.randn(H, HD, generator=g))


def register(codes: dict[tuple[int, str], scd.LinearCode]) -> str:
    """Load maps holding `codes` into this process's codec; their sha256."""
    maps = scd.Maps(codes=codes, rope=ROPE, meta={})
    sha = hashlib.sha256(maps.to_bytes()).hexdigest()
    codecs.LOWRANK.add_maps(scd.Maps(codes=codes, rope=ROPE, meta={}, sha256=sha))
    return sha


SHA = register({(1, "K"): code(0)})  # layer 1's K is coded; everything else travels raw
KV = torch.randn(1, H, T, HD, generator=torch.Generator().manual_seed(9))


def params(layer: int, kind: str, sha: str = SHA) -> CodecParams:
    return {codecs.MAPS_PARAM: sha, codecs.KIND_PARAM: kind, codecs.LAYER_PARAM: layer}


def header(layer: int, kind: str, sent: CodecParams, nbytes: int) -> TensorHeader:
    return TensorHeader(context_id="c", layer=layer, kind=kind, shape=list(KV.shape), dtype="float32", codec="lowrank",
                        codec_params=sent, nbytes=nbytes, checksum="")


def test_maps_not_loaded_here_are_refused():
    """A request or header naming maps this process has not loaded is an IntegrityError."""
    with pytest.raises(IntegrityError, match="not loaded"):
        codecs.LOWRANK.encode(KV, params(1, "K", "0" * 64))
    with pytest.raises(IntegrityError, match="not loaded"):
        codecs.LOWRANK.max_nbytes(tuple(KV.shape), KV.dtype, params(1, "K", "0" * 64))


@pytest.mark.parametrize("layer, kind", [(2, "K"), (1, "V")])
def test_a_header_laid_out_for_another_item_is_refused(layer, kind):
    """Codes encoded for layer 1's K, landing under a header for another layer or kind: refused."""
    payload, sent = codecs.LOWRANK.encode(KV, params(1, "K"))
    with pytest.raises(IntegrityError, match="laid out for layer 1 K"):
        codecs.LOWRANK.decode(payload, header(layer, kind, sent, payload.numel()), torch.empty_like(KV))


def test_a_payload_of_the_wrong_size_is_refused():
    """Codes one element short of [H, T, r] are an IntegrityError, the buffer untouched."""
    payload, sent = codecs.LOWRANK.encode(KV, params(1, "K"))
    out = torch.zeros_like(KV)
    with pytest.raises(IntegrityError, match="bytes of codes"):
        codecs.LOWRANK.decode(payload[:-4], header(1, "K", sent, payload.numel() - 4), out)
    assert not out.any()


def test_items_without_a_code_travel_raw():
    """Layer 1's V has no code: its payload is its raw bytes and decodes to the stored tensor."""
    payload, sent = codecs.LOWRANK.encode(KV, params(1, "V"))
    assert torch.equal(payload, codecs.payload_view(KV))  # bitwise: raw: the tensor's own bytes
    out = torch.empty_like(KV)
    codecs.LOWRANK.decode(payload, header(1, "V", sent, payload.numel()), out)
    assert torch.equal(out, KV)  # bitwise: raw decode copies the bytes


@pytest.mark.parametrize("layer, kind", [(1, "K"), (1, "V"), (3, "K")])
def test_max_nbytes_is_exact(layer, kind):
    """`max_nbytes` equals the payload encode makes: codes [H, T, r] where coded, raw elsewhere."""
    payload, _ = codecs.LOWRANK.encode(KV, params(layer, kind))
    assert codecs.LOWRANK.max_nbytes(tuple(KV.shape), KV.dtype, params(layer, kind)) == payload.numel()
    assert payload.numel() == (H * T * R * 4 if (layer, kind) == (1, "K") else KV.numel() * 4)


def test_codes_that_decode_out_of_range_fail_the_engines_check():
    """Maps whose decoder blows values past the engine's bound (finite in the file, so the maps
    load): the decoded K fails `check_values` in the partial prefill, an IntegrityError before use."""
    model = random_model("llama", seed=0, **TINY, num_key_value_heads=H)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    captured = capture_prefill(model, ids, e_layers=range(model.num_layers))
    sha = register({(2, "K"): code(1, scale=1e30)})
    with pytest.raises(IntegrityError, match="out of range"):
        prefill(model, ids + [5, 6], ReusePlan.full_reuse(), CodedSource(captured, "lowrank", {codecs.MAPS_PARAM: sha}))


def test_prepared_codes_serve_the_stored_tensor_and_its_token_prefixes():
    """Codes prepared when a context is stored are what `encode` sends for the tensor and for a
    token prefix of it (a narrow view), byte for byte as a fresh encode; any other view is
    encoded afresh; the entry goes with the stored tensor."""
    maps = codecs.LOWRANK.maps(SHA)
    stored = KV.clone()
    prepared = codecs.LOWRANK.prepare(stored, 1, "K", maps)
    assert prepared is not None and codecs.LOWRANK.prepare(stored, 1, "V", maps) is None  # no code for V
    prepared.fill_(7.0)  # a marker: a fresh encode never gives exactly this
    whole, _ = codecs.LOWRANK.encode(stored, params(1, "K"))
    prefix, _ = codecs.LOWRANK.encode(stored.narrow(2, 0, 5), params(1, "K"))
    assert torch.equal(whole, codecs.payload_view(prepared))  # bitwise: the prepared codes' bytes (a marker)
    assert torch.equal(prefix, codecs.payload_view(prepared[:, :5].contiguous()))  # bitwise: the prepared codes' bytes (a marker)
    shifted, _ = codecs.LOWRANK.encode(stored.narrow(2, 1, 5), params(1, "K"))  # not a leading range
    fresh = scd.encode(stored.narrow(2, 1, 5), "K", maps.code(1, "K"), maps.rope)  # type: ignore[arg-type]
    assert torch.equal(shifted, codecs.payload_view(fresh))  # bitwise: the same encode on the same view
    key = prepared_codes.start_of(stored, SHA)
    del stored
    assert key not in codecs.LOWRANK._prepared


def test_prepared_codes_serve_a_placed_context_and_its_token_prefixes():
    """A sender stores its contexts placed (`memfd.place`: views of one shared mapping): the codes
    prepared for a placed tensor are found for it and for a token prefix of it, not encoded on
    every pull; another item of the same mapping has codes of its own."""
    from droidmesh.shared.transport import memfd

    maps = codecs.LOWRANK.maps(SHA)
    k1, v1 = memfd.place([KV.clone(), KV.clone()])
    prepared = codecs.LOWRANK.prepare(k1, 1, "K", maps)
    assert prepared is not None
    prepared.fill_(7.0)  # a marker: a fresh encode never gives exactly this
    whole, _ = codecs.LOWRANK.encode(k1, params(1, "K"))
    prefix, _ = codecs.LOWRANK.encode(k1.narrow(2, 0, 5), params(1, "K"))
    assert torch.equal(whole, codecs.payload_view(prepared))  # bitwise: the prepared codes' bytes (a marker)
    assert torch.equal(prefix, codecs.payload_view(prepared[:, :5].contiguous()))  # bitwise: the prepared codes' bytes (a marker)
    other, _ = codecs.LOWRANK.encode(v1, params(1, "K"))  # the next item of the mapping: never prepared
    assert not torch.equal(other, whole)  # bitwise: the marker is no encode's output
