"""Every bulk channel (real UCX and NIXL in one process, and in-process) keeps one contract: order,
integrity checks, refusals."""

from __future__ import annotations

import asyncio
import importlib

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire.schemas import PullItem, PullRequest

TENSORS = {(l, k): torch.randn(1, 2, 33, 8) for l in range(3) for k in "KV"} | {(1, "E"): torch.randn(1, 33, 16)}
CHANNELS = ["inproc", "ucx", "nixl"]


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _buffers(items: list[PullItem]) -> list[torch.Tensor]:
    return [torch.empty((1, 33, 16) if it.kind == "E" else (1, 2, 33, 8)) for it in items]


async def _session(transport, issuer, body, lookup=None):
    server = make_server(transport, lookup or (lambda c, l, k: TENSORS.get((l, k)) if c == "ctx" else None),
                         lambda req: issuer.verify(req.context_id, req.token))
    address = await server.start()
    client = make_client(transport)
    try:
        return await body(client, address)
    finally:
        await client.close()
        await server.close()


def _pull_one(token: str, context: str = "ctx"):
    items = [PullItem(0, "K")]

    async def body(client, address):
        await client.pull(address, PullRequest(context_id=context, items=items, token=token), _buffers(items),
                          lambda *a: None, 10)

    return body


@pytest.mark.parametrize("transport", CHANNELS)
def test_items_arrive_in_request_order_and_intact(transport):
    """E first, then K/V by layer, each equal to the sender's tensor, in the caller's buffers."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    items = [PullItem(1, "E")] + [PullItem(l, k) for l in (0, 2) for k in "KV"]
    into = _buffers(items)
    got: list[tuple[PullItem, torch.Tensor]] = []

    async def body(client, address):
        return await client.pull(address, PullRequest(context_id="ctx", items=items, token=token), into,
                                 lambda it, t: got.append((it, t)), 10)

    nbytes = asyncio.run(_session(transport, issuer, body))
    assert [it for it, _ in got] == items
    assert all(t is buf for (_, t), buf in zip(got, into, strict=True))
    assert all(torch.equal(t, TENSORS[(it.layer, it.kind)]) for it, t in got)
    assert nbytes == sum(t.numel() * 4 for _, t in got)


@pytest.mark.parametrize("transport", CHANNELS)
def test_expired_token_is_refused(transport):
    """A token past its expiry is refused by the sender (TransferError naming unauthorized)."""
    clock = Clock()
    issuer = TokenIssuer(ttl_s=5, clock=clock)
    token, _ = issuer.issue("ctx")
    clock.t = 10
    with pytest.raises(TransferError, match="unauthorized: capability token expired"):
        asyncio.run(_session(transport, issuer, _pull_one(token)))


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize("forge", ["missing", "tampered", "other-context", "other-sender"])
def test_forged_grants_are_refused(transport, forge):
    """On every channel a pull with no token, a tampered MAC, another context's token or another
    sender's token is refused as unauthorized, and no byte is delivered."""
    issuer = TokenIssuer(ttl_s=60)
    good, _ = issuer.issue("ctx")
    token = {"missing": "", "tampered": good[:-4] + "0000", "other-context": issuer.issue("other")[0],
             "other-sender": TokenIssuer(ttl_s=60).issue("ctx")[0]}[forge]
    delivered: list[PullItem] = []

    async def body(client, address):
        items = [PullItem(0, "K")]
        await client.pull(address, PullRequest(context_id="ctx", items=items, token=token), _buffers(items),
                          lambda it, t: delivered.append(it), 10)

    with pytest.raises(TransferError, match="unauthorized"):
        asyncio.run(_session(transport, issuer, body))
    assert delivered == []


@pytest.mark.parametrize("transport", CHANNELS)
def test_layout_mismatch_and_corruption_are_integrity_errors(transport, monkeypatch):
    """A tensor whose shape differs from the receiver's buffer, or whose bytes do not match the
    header checksum, raises IntegrityError."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    wrong = {(0, "K"): torch.randn(1, 2, 32, 8)}
    with pytest.raises(IntegrityError, match="does not match the expected layout"):
        asyncio.run(_session(transport, issuer, _pull_one(token), lookup=lambda c, l, k: wrong.get((l, k))))
    module = importlib.import_module(f"droidmesh.shared.transport.{transport}")
    real = module.answer

    def corrupt(*a):
        response, payloads = real(*a)
        headers = [msgspec.structs.replace(h, checksum="0" * 16) for h in response.headers]
        return msgspec.structs.replace(response, headers=headers), payloads

    monkeypatch.setattr(module, "answer", corrupt)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        asyncio.run(_session(transport, issuer, _pull_one(token)))


@pytest.mark.parametrize("transport", CHANNELS)
def test_unknown_context_is_refused(transport):
    """Pulling a context the sender does not hold is a TransferError, not a hang."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("gone")
    with pytest.raises(TransferError, match="does not hold gone"):
        asyncio.run(_session(transport, issuer, _pull_one(token, "gone")))
