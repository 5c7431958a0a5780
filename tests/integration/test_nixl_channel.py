"""The NIXL channel's own guarantees beyond the shared contract: what a grant reveals (nothing
before one), frame bounds, codec payloads read from per-pull copies."""

from __future__ import annotations

import asyncio

import pytest
import torch

from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import NixlGrant
from droidmesh.shared.wire.schemas import CodecParams, PullItem, PullRequest, TensorHeader

pytest.importorskip("nixl_cu12")

ITEMS = [PullItem(0, "K"), PullItem(0, "V")]


def _store() -> dict[tuple[int, str], torch.Tensor]:
    return {(0, k): torch.randn(1, 2, 33, 8) for k in "KV"}


async def _frame(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, msg: schemas.Message,
                 kind: type[schemas.M]) -> schemas.M:
    data = schemas.encode(msg)
    writer.write(len(data).to_bytes(4, "big") + data)
    n = int.from_bytes(await reader.readexactly(4), "big")
    return schemas.decode(await reader.readexactly(n), kind)


async def _grant_for(token: str) -> tuple[NixlGrant, int]:
    """Speak the control protocol by hand, as a peer that skips the client's checks would: the
    first frame is a pull. (The grant, the sandboxes the server started for connections.)"""
    issuer = TokenIssuer(ttl_s=60)
    good, _ = issuer.issue("ctx")
    store = _store()
    server = make_server("nixl", lambda c, l, k: store.get((l, k)) if c == "ctx" else None,
                         lambda req: issuer.verify(req.context_id, req.token))
    host, _, port = (await server.start()).rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        grant = await _frame(writer, reader, PullRequest(context_id="ctx", items=ITEMS, token=token or good), NixlGrant)
        return grant, server.sandboxes.live()  # type: ignore[attr-defined]  # the nixl server's sandbox pool
    finally:
        writer.close()
        await server.close()


def test_forged_or_tampered_token_gets_no_descriptors():
    """A forged token, or a valid one with its MAC altered, is refused with no NIXL metadata and no
    regions, and no sandbox is started for that peer: nothing of the sender (no agent, no
    address, no memory) is described to it."""
    good, _ = TokenIssuer(ttl_s=60).issue("ctx")  # another sender's key: a forgery here
    for token in (good, "9999999999." + "0" * 64):
        grant, sandboxes = asyncio.run(_grant_for(token))
        assert grant.response.error and grant.response.error.startswith("unauthorized"), grant.response
        assert (grant.metadata, grant.regions, grant.response.headers) == (b"", [], [])
        assert sandboxes == 0


def test_grant_describes_exactly_the_requested_items():
    """An authorized grant carries one region per requested item, each the size of its header,
    and the metadata of the connection's own sandbox agent (its connection info: the first grant)."""
    grant, sandboxes = asyncio.run(_grant_for(""))
    assert grant.response.error is None and b"droidmesh-nixl-sandbox-" in grant.metadata and sandboxes == 1
    assert [r.nbytes for r in grant.regions] == [h.nbytes for h in grant.response.headers] == [2 * 33 * 8 * 4] * 2


def test_oversized_frame_is_refused_before_it_is_read():
    """A declared frame length beyond MAX_MESSAGE_BYTES closes the connection; no body is awaited."""

    async def run() -> bytes:
        server = make_server("nixl", lambda c, l, k: None, None)
        host, _, port = (await server.start()).rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write((schemas.MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
            await server.close()

    assert asyncio.run(run()) == b""


class NegateCodec:
    """A toy lossless codec whose payload is fresh memory (not the stored tensor's)."""

    name = "toy-negate"

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        return codecs.payload_view(t.contiguous()).bitwise_not(), {}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        codecs.payload_view(out).copy_(payload.bitwise_not())

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        return codecs.nbytes_of(shape, dtype)


def test_codec_payloads_are_read_from_per_pull_copies():
    """A codec's fresh payloads (not a stored tensor's own memory) reach the sandbox in a per-pull
    memfd and travel intact, staged and decoded, pull after pull on one connection."""
    store = _store()
    codecs.register(NegateCodec())

    async def run() -> list[torch.Tensor]:
        server = make_server("nixl", lambda c, l, k: store.get((l, k)), None)
        address = await server.start()
        client = make_client("nixl")
        into = [torch.empty(1, 2, 33, 8) for _ in ITEMS]
        try:
            for _ in range(2):  # the second request is read only after the first pull's NixlDone
                await client.pull(address, PullRequest(context_id="ctx", items=ITEMS, codec="toy-negate"), into,
                                  lambda *a: None, 10)
            return into
        finally:
            await client.close()
            await server.close()

    try:
        into = asyncio.run(run())
    finally:
        codecs.unregister("toy-negate")
    # bitwise: the toy codec inverts the bits twice
    assert all(torch.equal(t, store[(it.layer, it.kind)]) for it, t in zip(ITEMS, into, strict=True))
