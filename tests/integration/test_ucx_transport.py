"""The UCX bulk channel in one process (real UCX): order, integrity checks, refusals."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.errors import IntegrityError, TransferError
from shared.transport import ucx
from shared.transport.tokens import TokenIssuer
from shared.wire.schemas import PullItem, PullRequest

TENSORS = {(l, k): torch.randn(1, 2, 33, 8) for l in range(3) for k in "KV"} | {(1, "E"): torch.randn(1, 33, 16)}


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _expected(item: PullItem):  # type: ignore[no-untyped-def]
    return ([1, 33, 16] if item.kind == "E" else [1, 2, 33, 8]), torch.float32


async def _session(issuer: TokenIssuer, body, lookup=None):  # type: ignore[no-untyped-def]
    server = ucx.BulkServer(lookup or (lambda c, l, k: TENSORS.get((l, k)) if c == "ctx" else None),
                            lambda req: issuer.verify(req.context_id, req.token))
    port = server.start()
    client = ucx.BulkClient()
    try:
        return await body(client, port)
    finally:
        await client.close()
        await server.close()


def test_items_arrive_in_request_order_and_intact():
    """E first, then K/V by layer, each equal to the sender's tensor."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    items = [PullItem(1, "E")] + [PullItem(l, k) for l in (0, 2) for k in "KV"]
    got: list[tuple[PullItem, torch.Tensor]] = []

    async def body(client, port):  # type: ignore[no-untyped-def]
        return await client.pull("127.0.0.1", port, PullRequest(context_id="ctx", items=items, token=token),
                                 _expected, lambda it, t: got.append((it, t.clone())), 10)

    nbytes = asyncio.run(_session(issuer, body))
    assert [it for it, _ in got] == items
    assert all(torch.equal(t, TENSORS[(it.layer, it.kind)]) for it, t in got)
    assert nbytes == sum(t.numel() * 4 for _, t in got)


def test_expired_token_is_refused():
    """A token past its expiry is refused by the sender (TransferError naming unauthorized)."""
    clock = Clock()
    issuer = TokenIssuer(ttl_s=5, clock=clock)
    token, _ = issuer.issue("ctx")
    clock.t = 10

    async def body(client, port):  # type: ignore[no-untyped-def]
        await client.pull("127.0.0.1", port, PullRequest(context_id="ctx", items=[PullItem(0, "K")], token=token),
                          _expected, lambda *a: None, 10)

    with pytest.raises(TransferError, match="unauthorized: capability token expired"):
        asyncio.run(_session(issuer, body))


def test_layout_mismatch_and_corruption_are_integrity_errors(monkeypatch):
    """A tensor whose shape differs from the announced layout, or whose bytes do not match
    the header checksum, raises IntegrityError; the endpoint is then dropped, not reused."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    wrong = {(0, "K"): torch.randn(1, 2, 32, 8)}

    async def body(client, port):  # type: ignore[no-untyped-def]
        await client.pull("127.0.0.1", port, PullRequest(context_id="ctx", items=[PullItem(0, "K")], token=token),
                          _expected, lambda *a: None, 10)

    with pytest.raises(IntegrityError, match="does not match the announced layout"):
        asyncio.run(_session(issuer, body, lookup=lambda c, l, k: wrong.get((l, k))))
    real = ucx.header_for
    monkeypatch.setattr(ucx, "header_for", lambda *a: real(*a).__class__(**{
        **{f: getattr(real(*a), f) for f in real(*a).__struct_fields__}, "checksum": "0" * 16}))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        asyncio.run(_session(issuer, body))


def test_unknown_context_is_refused():
    """Pulling a context the sender does not hold is a TransferError, not a hang."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("gone")

    async def body(client, port):  # type: ignore[no-untyped-def]
        await client.pull("127.0.0.1", port, PullRequest(context_id="gone", items=[PullItem(0, "K")], token=token),
                          _expected, lambda *a: None, 10)

    with pytest.raises(TransferError, match="does not hold gone"):
        asyncio.run(_session(issuer, body))
