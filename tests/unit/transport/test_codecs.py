"""Wire codecs and the bulk protocol's checks, over the in-process channel (no sockets)."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.kv import quant
from droidmesh.shared.transport import codecs, inproc, integrity
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.wire.schemas import CodecParams, PullItem, PullRequest, TensorHeader

KV = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(1, 2, 5, 4)  # [1, kvh, T, hd]


class HalfCodec:
    """A toy codec: float32 sent as float16 (exact for these small integers), half the bytes."""

    name = "toy-half"

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        return codecs.payload_view(t.to(torch.float16)), {"from": "float32"}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        assert header.codec_params == {"from": "float32"}
        out.copy_(payload.view(torch.float16).reshape(out.shape))

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        return codecs.nbytes_of(shape, torch.float16)


@pytest.fixture
def toy_codec():
    codecs.register(HalfCodec())
    yield
    codecs.unregister("toy-half")


def _pull(codec: str = "raw", lookup=None) -> tuple[list[torch.Tensor], int]:
    async def run() -> tuple[list[torch.Tensor], int]:
        server = make_server("inproc", lookup or (lambda c, l, k: KV if (l, k) == (0, "K") else None), None)
        address = await server.start()
        client, got = make_client("inproc"), []
        try:
            n = await client.pull(address, PullRequest(context_id="c", items=[PullItem(0, "K")], codec=codec),
                                  [torch.empty(1, 2, 5, 4)], lambda it, t: got.append(t.clone()), 5)
            return got, n
        finally:
            await server.close()

    return asyncio.run(run())


def test_raw_is_registered_and_lands_in_place():
    """Raw arrives bit-exact, in the caller's own buffer, with the tensor's own byte count."""
    got, n = _pull()
    # bitwise: raw copies the bytes
    assert codecs.names() == ["int4", "int8", "layered", "lowrank", "raw"] and torch.equal(got[0], KV) and n == KV.numel() * 4


def test_a_registered_codec_is_encoded_by_the_sender_and_decoded_by_the_receiver(toy_codec):
    """A second codec plugs in through the registry alone: half the bytes, same tensor."""
    got, n = _pull("toy-half")
    assert torch.equal(got[0], KV) and n == KV.numel() * 2  # bitwise: float16 holds these integers exactly


def test_a_codec_the_sender_lacks_falls_back_to_raw():
    """Asking for an unknown codec still works: the sender answers raw, which every receiver knows."""
    got, n = _pull("toy-half")
    assert torch.equal(got[0], KV) and n == KV.numel() * 4  # bitwise: the raw fallback copies the bytes


def test_unknown_codec_in_a_header_is_refused(monkeypatch):
    """A header naming a codec this receiver lacks is an IntegrityError before any byte lands."""
    real = inproc.answer

    def relabel(*a):
        response, payloads, release, grantee = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, codec="zstd-9000") for h in response.headers]), payloads, release, grantee

    monkeypatch.setattr(inproc, "answer", relabel)
    with pytest.raises(IntegrityError, match="unknown codec 'zstd-9000'"):
        _pull()


def test_oversize_payload_claim_is_refused_before_allocation(monkeypatch):
    """A header declaring more bytes than the codec allows for the receiver's buffer is refused,
    and no buffer of the declared size is allocated."""
    real = inproc.answer
    allocated: list[int] = []
    empty = torch.empty

    def inflate(*a):
        response, payloads, release, grantee = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, nbytes=1 << 40) for h in response.headers]), payloads, release, grantee

    def spy(*shape, **kw):
        allocated.append(shape[0] if shape and isinstance(shape[0], int) else 0)
        return empty(*shape, **kw)

    monkeypatch.setattr(inproc, "answer", inflate)
    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(IntegrityError, match="encoded bytes, raw allows at most 160"):
        _pull()
    assert 1 << 40 not in allocated


def test_checksum_covers_the_payload():
    """One flipped byte changes the checksum both ends compare."""
    payload = codecs.payload_view(KV.clone())
    before = integrity.checksum(payload)
    payload[3] ^= 1
    assert integrity.checksum(payload) != before


def test_a_stored_tensors_checksum_is_computed_once_and_dropped_with_it(monkeypatch):
    """Raw pulls of the same stored tensor checksum it once; a freed tensor leaves no entry."""
    from droidmesh.shared.transport import answer

    calls = []
    real = integrity.checksum
    monkeypatch.setattr(integrity, "checksum", lambda p: calls.append(1) or real(p))
    store = {"ctx": KV.clone()}
    for _ in range(3):
        _pull(lookup=lambda c, l, k: store.get("ctx") if (l, k) == (0, "K") else None)
    assert len(calls) == 1 + 3  # once on the sender, once per landing on the receiver
    key = id(store["ctx"])
    assert key in answer._STORED_SUMS
    del store["ctx"]  # evicted: the tensor is freed, its entry goes with it
    assert key not in answer._STORED_SUMS


def test_a_device_payload_the_receiver_did_not_ask_for_is_refused(monkeypatch):
    """A header claiming device memory on a pull that asked for host bytes is an IntegrityError."""
    real = inproc.answer

    def claim_device(*a):
        response, payloads, release, grantee = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, codec_params={codecs.DEVICE_PARAM: "cuda"}) for h in response.headers]), payloads, release, grantee

    monkeypatch.setattr(inproc, "answer", claim_device)
    with pytest.raises(IntegrityError, match="did not ask for"):
        _pull()


# -- quantized codecs (int8, int4) -----------------------------------------------------------
STORED = {(0, "K"): torch.randn(1, 2, 9, 8), (0, "V"): torch.randn(1, 2, 9, 8), (1, "E"): torch.randn(1, 9, 16)}
ITEMS = [PullItem(1, "E"), PullItem(0, "K"), PullItem(0, "V")]


def _buffers_for(items: list[PullItem], tokens: int = 9) -> list[torch.Tensor]:
    return [torch.empty(1, tokens, 16) if it.kind == "E" else torch.empty(1, 2, tokens, 8) for it in items]


def _pull_quantized(codec: str, params: CodecParams | None = None, tokens: int = 0, into=None):
    """(landed tensors, pulled bytes, headers) of a pull of ITEMS with `codec` over inproc."""
    headers: list[TensorHeader] = []
    real = inproc.answer

    def spy(*a):
        served = real(*a)
        headers.extend(served.response.headers)
        return served

    async def run():
        server = make_server("inproc", lambda c, l, k: STORED.get((l, k)), None)
        address = await server.start()
        got: list[torch.Tensor] = []
        try:
            n = await make_client("inproc").pull(
                address, PullRequest(context_id="c", items=ITEMS, codec=codec, codec_params=params or {}, tokens=tokens),
                into if into is not None else _buffers_for(ITEMS, tokens or 9), lambda it, t: got.append(t.clone()), 5)
            return got, n
        finally:
            await server.close()

    inproc.answer = spy  # restored below
    try:
        got, n = asyncio.run(run())
    finally:
        inproc.answer = real
    return got, n, headers


def _int4_scales(x: torch.Tensor, g: int, kind: str) -> torch.Tensor:
    """Each value's int4 scale: K per channel over g tokens (the last group shorter), else per g dims."""
    if kind != "K":
        xg = x.reshape(-1, g)  # [n_groups, g]
        return ((xg.amax(1, keepdim=True) - xg.amin(1, keepdim=True)) / 15).expand_as(xg).reshape(x.shape)
    xt, scale = x.transpose(-1, -2), torch.empty_like(x).transpose(-1, -2)  # [..., hd, T] each
    for s in range(0, xt.shape[-1], g):
        seg = xt[..., s:s + g]
        scale[..., s:s + g] = (seg.amax(-1, keepdim=True) - seg.amin(-1, keepdim=True)) / 15
    return scale.transpose(-1, -2)


@pytest.mark.parametrize("codec,params", [("int8", {}), ("int4", {}), ("int4", {"group": 4})])
def test_quantized_pulls_land_within_the_bound_in_fewer_bytes(codec, params):
    """int8 / int4 over the channel: each item decodes within its bound; the bytes pulled are
    the exact layout sizes (K per channel, int8's E per token and 32 dims), a fraction of raw's."""
    got, n, headers = _pull_quantized(codec, params)
    group = params.get("group", 32)
    for item, t, h in zip(ITEMS, got, headers, strict=True):
        x = STORED[(item.layer, item.kind)]
        if codec == "int8":
            scale = x.abs().amax(dim=quant.int8_axis(item.kind, x.dim()), keepdim=True) / 127
            assert h.codec_params == {"kind": item.kind} and h.nbytes == quant.int8_nbytes(tuple(x.shape), item.kind)
        else:
            g = math.gcd(group, x.shape[-1])  # the default: 32 where it divides
            scale = _int4_scales(x, g, item.kind)
            assert h.codec_params == {"group": g, "kind": item.kind}
            assert h.nbytes == quant.int4_nbytes(tuple(x.shape), g, item.kind)
        assert h.codec == codec and bool(((t - x).abs() <= scale / 2 + 1e-6).all())
    raw = sum(t.numel() * 4 for t in STORED.values())
    assert n == sum(h.nbytes for h in headers) and n < 0.7 * raw  # tiny dims and groups: scales weigh more than at 128 / 32


def test_a_prefix_pull_quantizes_only_the_tokens_asked_for():
    """tokens=5: per-channel K scales are those of the 5-token prefix, and the payload its size."""
    got, n, headers = _pull_quantized("int8", tokens=5)
    k = STORED[(0, "K")][:, :, :5]
    expected = torch.empty_like(k)
    quant.int8_dequantize(quant.int8_quantize(k, "K"), "K", expected)
    # bitwise: the same quantizer and decode on the same prefix; scales from maxima, exact in any order
    assert torch.equal(got[1], expected) and headers[1].nbytes == quant.int8_nbytes((1, 2, 5, 8), "K")


def test_max_nbytes_is_exact_for_the_kind_and_a_safe_maximum_without_one():
    """int8's bound is the exact size for the kind in the params, else the largest over kinds;
    int4's is exact for the group (default 32) and the kind, and refuses a group that does not fit."""
    int8, int4 = codecs.get("int8"), codecs.get("int4")
    shape = (1, 2, 40, 8)  # more tokens than dims: per-token (V) scales outnumber per-channel (K) ones
    sizes = {kind: int8.max_nbytes(shape, torch.float32, {"kind": kind}) for kind in "KV"}
    assert sizes == {"K": 640 + 4 * 16, "V": 640 + 4 * 80}
    assert int8.max_nbytes(shape, torch.float32, {}) == sizes["V"]
    assert int8.max_nbytes((1, 40, 64), torch.bfloat16, {"kind": "E"}) == 2560 + 4 * 80  # E: per token and 32 dims
    assert int8.max_nbytes((1, 40, 64), torch.bfloat16, {}) == 2560 + 4 * 80  # no kind: the largest, E's here
    assert int4.max_nbytes((1, 2, 40, 64), torch.float32, {"kind": "V"}) == 2560 + 8 * 160  # 5,120 values: 160 groups of 32
    assert int4.max_nbytes((1, 2, 40, 64), torch.float32, {"kind": "V", "group": 64}) == 2560 + 8 * 80
    assert int4.max_nbytes((1, 2, 40, 64), torch.float32, {"kind": "K"}) == 2560 + 8 * 256  # 128 channels x 2 token groups
    assert int4.max_nbytes((1, 2, 40, 64), torch.float32, {}) == 2560 + 8 * 256  # no kind: the largest, K's here
    with pytest.raises(IntegrityError, match="'kind' = 'Q'"):
        int8.max_nbytes(shape, torch.float32, {"kind": "Q"})
    with pytest.raises(IntegrityError, match="group 12 does not divide"):
        int4.max_nbytes(shape, torch.float32, {"group": 12})


@pytest.mark.parametrize("group", [0, -8, 3, 1 << 40, "8"])
def test_a_request_for_a_group_that_does_not_fit_is_refused_by_the_sender(group):
    """The sender refuses the pull (the receiver falls back, told why), nothing lands."""
    with pytest.raises(TransferError, match="sender refused the pull: integrity: int4: group"):
        _pull_quantized("int4", {"group": group})


def _tamper(monkeypatch, edit):
    """Make the in-process sender's answer go through `edit(headers, payloads)` (checksums redone)."""
    real = inproc.answer

    def tampered(*a):
        response, payloads, release, grantee = real(*a)
        headers = edit(list(response.headers), payloads)
        headers = [msgspec.structs.replace(h, nbytes=p.numel(), checksum=integrity.checksum(p))
                   for h, p in zip(headers, payloads, strict=True)]
        return msgspec.structs.replace(response, headers=headers), payloads, release, grantee

    monkeypatch.setattr(inproc, "answer", tampered)


def _pull_nothing_lands(codec: str, match: str) -> None:
    """The pull raises IntegrityError matching `match` and the tampered item is never delivered."""
    landed: list[PullItem] = []

    async def run():
        server = make_server("inproc", lambda c, l, k: STORED.get((l, k)), None)
        address = await server.start()
        try:
            await make_client("inproc").pull(address, PullRequest(context_id="c", items=ITEMS, codec=codec),
                                             _buffers_for(ITEMS), lambda it, t: landed.append(it), 5)
        finally:
            await server.close()

    with pytest.raises(IntegrityError, match=match):
        asyncio.run(run())
    assert ITEMS[1] not in landed


def _set_params(i: int, params: CodecParams):
    return lambda hs, ps: [msgspec.structs.replace(h, codec_params=params) if j == i else h for j, h in enumerate(hs)]


@pytest.mark.parametrize("codec,params,match", [
    ("int8", {"kind": "V"}, "layer 0 K: int8 params|laid out for kind 'V'"),
    ("int8", {}, "int8 params"),
    ("int8", {"kind": "K", "group": 8}, "int8 params"),
    ("int4", {"group": 2000, "kind": "K"}, "a K group of 2000 tokens"),
    ("int4", {"group": 4, "kind": "K"}, "payload of"),  # fits the layout, but the payload was made with 8
    ("int4", {"group": 8}, "int4 params"),  # the kind, which K's layout depends on, not echoed
    ("int4", {"group": 8, "kind": "V"}, "laid out for kind 'V'|allows at most"),  # V's layout is smaller than K's here
])
def test_header_params_that_do_not_match_the_layout_are_refused(monkeypatch, codec, params, match):
    """A K header whose params contradict its kind, its payload or its buffer is an IntegrityError."""
    _tamper(monkeypatch, _set_params(1, params))
    _pull_nothing_lands(codec, match)


def test_a_payload_of_another_size_is_refused(monkeypatch):
    """A (checksum-valid) payload one byte short of the layout's size is an IntegrityError."""
    def shorten(hs, ps):
        ps[1] = ps[1][:-1]
        return hs

    _tamper(monkeypatch, shorten)
    _pull_nothing_lands("int8", "layer 0 K: int8: payload of")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_scale_that_decodes_to_nan_is_refused(monkeypatch, codec):
    """A NaN scale with a valid checksum: IntegrityError at landing, the item never delivered."""
    def poison(hs, ps):
        ps[1] = ps[1].clone()
        ps[1][-4:].view(torch.float32)[0] = float("nan")  # the last scale (int8) / zero point (int4)
        return hs

    _tamper(monkeypatch, poison)
    _pull_nothing_lands(codec, "layer 0 K: int[48]: (negative or NaN scales|decoded values would reach nan)")


def test_quantized_decode_into_a_non_contiguous_buffer():
    """A strided receive buffer (a view) gets the same values as a contiguous one."""
    base = [torch.empty(2, 9, 16) if it.kind == "E" else torch.empty(1, 2, 9, 16) for it in ITEMS]
    strided = [b[:1] if it.kind == "E" else b[..., ::2] for b, it in zip(base, ITEMS, strict=True)]  # [1, 9, 16] / [1, 2, 9, 8]
    for codec in ("int8", "int4"):
        got, _, _ = _pull_quantized(codec, into=strided)
        flat, _, _ = _pull_quantized(codec)
        # bitwise: the same decode, per element; only the buffer's strides differ
        assert all(torch.equal(a, b) for a, b in zip(got, flat, strict=True))


# -- layered (raw / int8 / int4 per layer) ---------------------------------------------------
def test_a_layered_pull_sends_each_layer_under_its_own_codec():
    """layers "48": layer 0's K and V as int4, layer 1's E as int8, in one pull; each item lands
    as its own codec would land it alone, with that codec's bytes."""
    got, n, headers = _pull_quantized("layered", codecs.layers_param(["int4", "int8"]))
    alone = {"int4": _pull_quantized("int4"), "int8": _pull_quantized("int8")}
    for i, (item, h) in enumerate(zip(ITEMS, headers, strict=True)):
        sub = "int4" if item.layer == 0 else "int8"
        # bitwise: the same quantizer and decode on the same tensor; only the codec that picked it differs
        assert torch.equal(got[i], alone[sub][0][i]) and h.nbytes == alone[sub][2][i].nbytes
        assert h.codec == "layered" and h.codec_params == {"layers": "48", "layer": item.layer,
                                                           **alone[sub][2][i].codec_params}
    assert n == alone["int8"][2][0].nbytes + sum(h.nbytes for h in alone["int4"][2][1:])
    raw_e, _, raw_headers = _pull_quantized("layered", {"layers": "r8"})
    # bitwise: raw copies the bytes
    assert torch.equal(raw_e[1], STORED[(0, "K")]) and raw_headers[1].codec_params == {"layers": "r8", "layer": 0}


@pytest.mark.parametrize("params,match", [
    ({"layers": "4"}, "layer 1 outside the 1 layers"),  # the E item's layer is not covered
    ({"layers": "4x"}, "a string of"),
    ({"layers": ""}, "a string of"),
    ({"layers": 48}, "a string of"),
    ({}, "a string of"),
])
def test_a_layered_request_that_does_not_cover_its_items_is_refused_by_the_sender(params, match):
    with pytest.raises(TransferError, match=f"sender refused the pull: integrity: layered: .*{match}"):
        _pull_quantized("layered", params)


@pytest.mark.parametrize("params,match", [
    # another layer's params; then one param too many; then the letter changed under it
    ({"layers": "48", "layer": 1, "group": 8, "kind": "K"}, "layered params for layer 1|allows at most"),
    ({"layers": "48", "layer": 0, "group": 8, "kind": "K", "tokens": 9}, "layered params .* for a int4 item"),
    ({"layers": "88", "layer": 0, "group": 8, "kind": "K"}, "layered params .* for a int8 item|allows at most"),
    ({"layers": "88", "layer": 0, "kind": "K"}, "payload of|allows at most"),  # int8's layout, int4's payload
    ({"layers": "4", "layer": 0}, "int4 params"),  # int4's group left out
])
def test_layered_header_params_that_do_not_match_the_item_are_refused(monkeypatch, params, match):
    _tamper(monkeypatch, _set_params(1, params))
    with pytest.raises(IntegrityError, match=match):
        _pull_one_layered(codecs.layers_param(["int4", "int8"]))


def _pull_one_layered(params: CodecParams) -> None:
    async def run():
        server = make_server("inproc", lambda c, l, k: STORED.get((l, k)), None)
        address = await server.start()
        try:
            await make_client("inproc").pull(address, PullRequest(context_id="c", items=ITEMS, codec="layered",
                                                                  codec_params=params),
                                             _buffers_for(ITEMS), lambda it, t: None, 5)
        finally:
            await server.close()

    asyncio.run(run())


def test_layers_param_and_its_check():
    assert codecs.layers_param(["raw", "int8", "int4"]) == {"layers": "r84"}
    with pytest.raises(KeyError, match="lowrank"):
        codecs.layers_param(["lowrank"])
    assert codecs.LAYERED.check({"layers": "r84"}, 3) == "r84"
    with pytest.raises(IntegrityError, match="3 layers' codecs for a model of 30 layers"):
        codecs.LAYERED.check({"layers": "r84"}, 30)
