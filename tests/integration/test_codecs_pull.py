"""A receiver pulls a real context over the in-process bulk channel with the int8 / int4 codecs
and generates: same greedy tokens as the raw-codec run, logits within a stated tolerance.

Tolerance (max |logit - raw's logit| over the prompt's suffix, relative to raw's max |logit|):
int8 1 %, int4 7 %. Each reused K / V / E element is off by at most scale / 2: for int8 about
0.4 % of its slice's max |x| (1 / 254), for int4 about 3.3 % of its group's range (1 / 30). A
layer maps a small relative change of its inputs to a change of the same order in its outputs,
so the logits' relative change stays of the order of the largest per-element relative error; the
tolerances are about twice that (measured on this pair: 0.07 % and 1.2 %; int4 with group 8:
0.7 %). For scale, raw reuse itself (the sender's weights differ in layers 2..3) moved the last
logits of an identically built pair by ~85 % of max |logit| from the receiver's full prefill:
quantization adds little to the error reuse already accepts.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.kv import quant
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import Generation, generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.profiling import layer_codecs, scd_fit
from droidmesh.shared.transport import codecs, inproc, integrity
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.transport.inproc import CodedSource
from droidmesh.shared.transport.pull import pull_into, pull_items, source_for
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import CodecParams

TOLERANCE = {"int8": 0.01, "int4": 0.07}  # of raw's max |logit| (module docstring)
PLAN = ReusePlan.recompute(2, 4)  # E of layer 2 and K / V of layers 0, 1, 4, 5 travel


@pytest.fixture(scope="module")
def context(tiny_models):
    """(sender's store, holder announcement, context ids, question ids) for a 200-token context."""
    sender, receiver = tiny_models
    g = torch.Generator().manual_seed(3)
    vocab = receiver.model.config.vocab_size
    ctx, q = torch.randint(0, vocab, (200,), generator=g).tolist(), torch.randint(0, vocab, (8,), generator=g).tolist()
    cap = capture_prefill(sender, ctx + [5, 5], e_layers=PLAN.e_layers)  # longer than the prompt's reusable prefix
    store = CacheStore(budget_bytes=1 << 28)
    store.put("ctx", cap)
    issuer = TokenIssuer(ttl_s=600)
    holder = schemas.CacheAvailable(
        sender_id="s", model_id="m", model_sha256="", fingerprint=schemas.fingerprint_to_wire(cap.fingerprint),
        fingerprint_id=cap.fingerprint.id, context_id="ctx", token_ids=list(cap.token_ids), dtype=dtype_name(receiver.dtype),
        kv_nbytes=cap.kv_nbytes(), e_layers=sorted(cap.e), e_nbytes=0, transport="inproc", address="", published_at=0.0)
    return store, issuer, holder, ctx, q


def _pull(tiny_models, context, codec: str, params: CodecParams | None = None) -> tuple[ArrivingSource, int]:
    """Pull per PLAN with `codec` into a fresh source for the prompt: (source, bytes pulled);
    the source is also `LAST[0]`, for a pull that raises."""
    _, receiver = tiny_models
    store, issuer, holder, ctx, q = context

    async def pull():
        server = make_server("inproc", store.tensor, lambda req: issuer.verify(req.context_id, req.token), pin=store.hold)
        address = await server.start()
        here = msgspec.structs.replace(holder, address=address)
        source = LAST[0] = source_for(here, ctx + q)
        try:
            n = await pull_into(make_client("inproc"), here, pull_items(PLAN, receiver.num_layers), receiver, source, 10,
                                token=issuer.issue("ctx")[0], codec=codec, codec_params=params)
        finally:
            await server.close()
        return source, n

    return asyncio.run(pull())


LAST: list[ArrivingSource | None] = [None]  # the latest pull's source


def _run(tiny_models, context, codec: str, params: CodecParams | None = None) -> tuple[Generation, int]:
    """`_pull`, then 16 greedy tokens on the receiver: (generation, bytes pulled)."""
    source, n = _pull(tiny_models, context, codec, params)
    _, _, _, ctx, q = context
    return generate(tiny_models[1], ctx + q, PLAN, source, max_new_tokens=16), n


@pytest.mark.parametrize("codec,params", [("int8", None), ("int4", None), ("int4", {"group": 8})])
def test_quantized_pull_generates_what_the_raw_pull_does(tiny_models, context, codec, params):
    """Same 16 greedy tokens as raw; suffix logits within TOLERANCE; the exact layout's bytes."""
    raw, raw_bytes = _run(tiny_models, context, "raw")
    got, n = _run(tiny_models, context, codec, params)
    assert got.tokens == raw.tokens
    drift = float((got.prefill.logits - raw.prefill.logits).abs().max())
    assert drift <= TOLERANCE[codec] * float(raw.prefill.logits.abs().max())
    receiver = tiny_models[1]
    m = len(context[3])
    kv, e = receiver.kv_shape(m), receiver.e_shape(m)  # [1, 2, m, 16], [1, m, 64]
    kv_layers = len(PLAN.reused_layers(receiver.num_layers))
    if codec == "int8":
        expected = kv_layers * (quant.int8_nbytes(kv, "K") + quant.int8_nbytes(kv, "V")) + quant.int8_nbytes(e, "E")
    else:
        group = (params or {}).get("group")
        kv_group, e_group = (group, group) if isinstance(group, int) else (quant.default_group(kv), quant.default_group(e))
        kv_bytes = quant.int4_nbytes(kv, kv_group, "K") + quant.int4_nbytes(kv, kv_group, "V")
        expected = kv_layers * kv_bytes + quant.int4_nbytes(e, e_group, "E")
    assert n == expected and n < 0.4 * raw_bytes


def test_a_layered_pull_generates_what_the_raw_pull_does_in_each_layers_bytes(tiny_models, context):
    """Layers 0 and 1 int4, 4 and 5 int8, the group start's E raw (`layer_codecs.wire_for`): the
    same 16 greedy tokens as raw, suffix logits within int4's tolerance, and each item the bytes
    of its own layer's codec."""
    receiver = tiny_models[1]
    wire = layer_codecs.wire_for(PLAN, receiver.num_layers, [0, 1])
    assert dict(wire.params) == {"layers": "44rr88"}
    raw, _ = _run(tiny_models, context, "raw")
    got, n = _run(tiny_models, context, wire.codec, dict(wire.params))
    assert got.tokens == raw.tokens
    drift = float((got.prefill.logits - raw.prefill.logits).abs().max())
    assert drift <= TOLERANCE["int4"] * float(raw.prefill.logits.abs().max())
    m = len(context[3])
    kv, e = receiver.kv_shape(m), receiver.e_shape(m)
    int4 = 2 * (quant.int4_nbytes(kv, quant.default_group(kv), "K") + quant.int4_nbytes(kv, quant.default_group(kv), "V"))
    int8 = 2 * (quant.int8_nbytes(kv, "K") + quant.int8_nbytes(kv, "V"))
    assert n == int4 + int8 + codecs.nbytes_of(e, receiver.dtype)


def test_a_poisoned_quantized_item_is_refused_and_never_delivered(tiny_models, context, monkeypatch):
    """A NaN scale in layer 4's V (checksum redone) fails the pull with an IntegrityError naming it;
    layer 4 never reaches the engine's source (the receiver falls back to its own prefill)."""
    real = inproc.answer

    def poison(*a):
        response, payloads, release, grantee = real(*a)
        i = next(j for j, h in enumerate(response.headers) if (h.layer, h.kind) == (4, "V"))
        payloads[i] = payloads[i].clone()
        payloads[i][-4:].view(torch.float32)[0] = float("nan")  # the last per-token scale
        headers = list(response.headers)
        headers[i] = msgspec.structs.replace(headers[i], checksum=integrity.checksum(payloads[i]))
        return msgspec.structs.replace(response, headers=headers), payloads, release, grantee

    monkeypatch.setattr(inproc, "answer", poison)
    with pytest.raises(IntegrityError, match="layer 4 V: int8: negative or NaN scales"):
        _pull(tiny_models, context, "int8")
    source = LAST[0]
    assert source is not None and {"e2", "kv0", "kv1"} <= set(source.arrived_at) and "kv4" not in source.arrived_at


@pytest.fixture(scope="module")
def lowrank_maps(tiny_models):
    """Maps for the tiny pair fitted on 4 random 200-token contexts (every reused layer at 90 %
    of the fitted variance), registered with the lowrank codec."""
    sender, receiver = tiny_models
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(0, receiver.model.config.vocab_size, (200,), generator=g).tolist() for _ in range(4)]
    maps, _ = scd_fit.maps_for(scd_fit.calibrate(sender, receiver, contexts, progress=False), PLAN, 0.9)
    codecs.LOWRANK.add_maps(maps)
    return maps


def test_lowrank_pull_generates_what_the_in_process_codes_do(tiny_models, context, lowrank_maps):
    """Over the channel, lowrank gives the same tokens and logits as the engine on the same codes
    in process, and moves exactly the codes' bytes (plus the raw E of layer 2, which has no code)."""
    store, _, _, ctx, q = context
    params = {codecs.MAPS_PARAM: lowrank_maps.sha256}
    got, n = _run(tiny_models, context, "lowrank", params)
    ref = generate(tiny_models[1], ctx + q, PLAN, CodedSource(store.get("ctx"), "lowrank", params, tokens=len(ctx)),
                   max_new_tokens=16)
    # bitwise: the same answer, landing and engine on the same shapes; the channel copies the codes
    assert got.tokens == ref.tokens and torch.equal(got.prefill.logits, ref.prefill.logits)
    receiver, m = tiny_models[1], len(ctx)
    kvh, itemsize = receiver.fingerprint.num_kv_heads, receiver.dtype.itemsize
    codes = sum(kvh * m * lowrank_maps.code(l, k).rank * itemsize  # type: ignore[union-attr]
                for l in PLAN.reused_layers(receiver.num_layers) for k in ("K", "V"))
    assert n == codes + math.prod(receiver.e_shape(m)) * itemsize


def _tamper(monkeypatch, layer: int, kind: str, change) -> None:
    """Make the in-process sender's answer apply `change(header, payload) -> (header, payload)` to
    one item, the checksum redone (a sender that lies, not a corrupted wire)."""
    real = inproc.answer

    def answer(*a):
        response, payloads, release, grantee = real(*a)
        i = next(j for j, h in enumerate(response.headers) if (h.layer, h.kind) == (layer, kind))
        header, payloads[i] = change(response.headers[i], payloads[i].clone())
        headers = list(response.headers)
        headers[i] = msgspec.structs.replace(header, checksum=integrity.checksum(payloads[i]), nbytes=payloads[i].numel())
        return msgspec.structs.replace(response, headers=headers), payloads, release, grantee

    monkeypatch.setattr(inproc, "answer", answer)


def test_lowrank_codes_decoding_to_inf_never_reach_the_cache(tiny_models, context, lowrank_maps, monkeypatch):
    """Codes of layer 4's K set to a huge value decode beyond the value bound: the engine refuses
    the layer with an IntegrityError naming it (the receiver falls back), nothing half-applied."""

    def huge(header, payload):
        payload.view(tiny_models[1].dtype).fill_(3e38)
        return header, payload

    _tamper(monkeypatch, 4, "K", huge)
    source, _ = _pull(tiny_models, context, "lowrank", {codecs.MAPS_PARAM: lowrank_maps.sha256})
    _, _, _, ctx, q = context
    with pytest.raises(IntegrityError, match="layer 4 K: values out of range"):
        generate(tiny_models[1], ctx + q, PLAN, source, max_new_tokens=2)


@pytest.mark.parametrize("bad", ["other_maps", "other_layer", "short_payload"])
def test_lowrank_headers_that_do_not_fit_are_refused(tiny_models, context, lowrank_maps, monkeypatch, bad):
    """A header naming maps not loaded here, another layer's layout, or a payload that is not the
    codes' size: the pull fails with an IntegrityError before the item is delivered."""

    def change(header, payload):
        p = dict(header.codec_params)
        if bad == "other_maps":
            p[codecs.MAPS_PARAM] = "cd" * 32
        elif bad == "other_layer":
            p[codecs.LAYER_PARAM] = 5
        else:
            payload = payload[:-2]
        return msgspec.structs.replace(header, codec_params=p), payload

    _tamper(monkeypatch, 4, "V", change)
    with pytest.raises(IntegrityError, match="not loaded here|lowrank laid out for layer 5|bytes of codes"):
        _pull(tiny_models, context, "lowrank", {codecs.MAPS_PARAM: lowrank_maps.sha256})
    assert "kv4" not in LAST[0].arrived_at  # type: ignore[union-attr]
