"""Wire codecs and the bulk protocol's checks, over the in-process channel (no sockets)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport import codecs, inproc
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
    assert codecs.names() == ["raw"] and torch.equal(got[0], KV) and n == KV.numel() * 4


def test_a_registered_codec_is_encoded_by_the_sender_and_decoded_by_the_receiver(toy_codec):
    """A second codec plugs in through the registry alone: half the bytes, same tensor."""
    got, n = _pull("toy-half")
    assert torch.equal(got[0], KV) and n == KV.numel() * 2


def test_a_codec_the_sender_lacks_falls_back_to_raw():
    """Asking for an unknown codec still works: the sender answers raw, which every receiver knows."""
    got, n = _pull("toy-half")
    assert torch.equal(got[0], KV) and n == KV.numel() * 4


def test_unknown_codec_in_a_header_is_refused(monkeypatch):
    """A header naming a codec this receiver lacks is an IntegrityError before any byte lands."""
    real = inproc.answer

    def relabel(*a):
        response, payloads, release = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, codec="zstd-9000") for h in response.headers]), payloads, release

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
        response, payloads, release = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, nbytes=1 << 40) for h in response.headers]), payloads, release

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
    before = codecs.checksum(payload)
    payload[3] ^= 1
    assert codecs.checksum(payload) != before


def test_a_stored_tensors_checksum_is_computed_once_and_dropped_with_it(monkeypatch):
    """Raw pulls of the same stored tensor checksum it once; a freed tensor leaves no entry."""
    from droidmesh.shared.transport import bulk

    calls = []
    real = codecs.checksum
    monkeypatch.setattr(codecs, "checksum", lambda p: calls.append(1) or real(p))
    store = {"ctx": KV.clone()}
    for _ in range(3):
        _pull(lookup=lambda c, l, k: store.get("ctx") if (l, k) == (0, "K") else None)
    assert len(calls) == 1 + 3  # once on the sender, once per landing on the receiver
    key = id(store["ctx"])
    assert key in bulk._STORED_SUMS
    del store["ctx"]  # evicted: the tensor is freed, its entry goes with it
    assert key not in bulk._STORED_SUMS


def test_a_device_payload_the_receiver_did_not_ask_for_is_refused(monkeypatch):
    """A header claiming device memory on a pull that asked for host bytes is an IntegrityError."""
    real = inproc.answer

    def claim_device(*a):
        response, payloads, release = real(*a)
        return msgspec.structs.replace(response, headers=[
            msgspec.structs.replace(h, codec_params={codecs.DEVICE_PARAM: "cuda"}) for h in response.headers]), payloads, release

    monkeypatch.setattr(inproc, "answer", claim_device)
    with pytest.raises(IntegrityError, match="did not ask for"):
        _pull()
