"""`bulk.land_async`: where a landed item is verified and decoded, and what a cancel waits for."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport import codecs, integrity, placement
from droidmesh.shared.transport.bulk import Landing, land_async
from droidmesh.shared.wire.schemas import PullItem, TensorHeader
from tests.unit.transport.cancels import returned_early


def _landing(t: torch.Tensor, codec_name: str, checksum: str | None = None) -> Landing:
    """`t` encoded by `codec_name` as a sender would, received into a fresh buffer of its shape."""
    codec = codecs.get(codec_name)
    payload, params = codec.encode(t, {codecs.KIND_PARAM: "K", codecs.LAYER_PARAM: 0})
    out = torch.empty_like(t)
    header = TensorHeader(context_id="c", layer=0, kind="K", shape=list(t.shape), dtype="float32", codec=codec_name,
                          codec_params=params, nbytes=payload.numel(),
                          checksum=integrity.checksum(payload) if checksum is None else checksum)
    land = Landing(PullItem(0, "K"), header, codec, out, placement.receive_place(codec, header, out))
    land.recv.copy_(payload)  # the bytes the channel received
    return land


def test_a_host_payload_received_in_place_lands_on_the_loop_and_a_quantized_one_on_a_decoding_thread():
    t = torch.randn(1, 2, 64, 16)  # [1, kvh, T, hd]
    raw, int8 = _landing(t, "raw"), _landing(t, "int8")
    assert raw.in_place and not raw.costs_time() and int8.costs_time()
    threads: dict[str, str] = {}
    for land in (raw, int8):
        decode = land.codec.decode

        def noted(payload, header, out, decode=decode, name=land.header.codec):
            threads[name] = threading.current_thread().name
            decode(payload, header, out)

        land.codec = type("Noted", (), {"decode": staticmethod(noted)})()

    async def both():
        return await land_async(raw), await land_async(int8), threading.current_thread().name

    got_raw, got_int8, loop_thread = asyncio.run(both())
    assert threads["raw"] == loop_thread
    assert threads["int8"].startswith("droidmesh-decode")
    assert torch.equal(got_raw, t)  # bitwise: raw bytes received in place
    torch.testing.assert_close(got_int8, t, atol=t.abs().max().item() / 100, rtol=0)  # int8: 1/127 of the row's range


def test_a_landing_cancelled_twice_returns_only_once_its_decoding_thread_is_done():
    t = torch.randn(1, 2, 32, 16)
    land = _landing(t, "int8")
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()
    decode = land.codec.decode

    def gated(payload, header, out):
        entered.set()
        gate.wait(10)
        decode(payload, header, out)
        finished.set()

    land.codec = type("Gated", (), {"decode": staticmethod(gated)})()

    assert not asyncio.run(returned_early(land_async(land), entered, gate))
    assert finished.is_set()


def test_a_checksum_mismatch_found_on_a_decoding_thread_fails_the_landing():
    land = _landing(torch.randn(1, 2, 32, 16), "int8", checksum="0" * 16)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        asyncio.run(land_async(land))
