"""A whole reuse plan in one pull, over every bulk channel: byte for byte what pulling each item on
its own gives, whole or cut to a prefix, small enough to be read inline or large enough for the
copy lanes; and a forged or over-broad plan request is refused before a byte lands."""

from __future__ import annotations

import asyncio

import pytest
import torch

from droidmesh.shared.errors import BadMessageError, TransferError
from droidmesh.shared.transport.bulk import MAX_ITEMS
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire.schemas import PullItem, PullRequest
from tests.integration.test_bulk_channels import CHANNELS, _session

LAYERS, KVH, HD, D = 8, 3, 64, 192
E_LAYERS = (2, 5)


def _context(tokens: int) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    kv = {(l, k): torch.randn(1, KVH, tokens, HD, generator=g) for l in range(LAYERS) for k in "KV"}
    return kv | {(l, "E"): torch.randn(1, tokens, D, generator=g) for l in E_LAYERS}


def _plan() -> list[PullItem]:
    """As `pull.pull_items` orders a partial plan recomputing [2, 5) from E: E first, then the
    reused layers' K and V by layer."""
    return [PullItem(l, "E") for l in E_LAYERS] + [PullItem(l, k) for l in (0, 1, 5, 6, 7) for k in "KV"]


def _buffer(item: PullItem, tokens: int) -> torch.Tensor:
    shape = (1, tokens, D) if item.kind == "E" else (1, KVH, tokens, HD)
    return torch.full(shape, float("nan"))  # NaN: a byte never written shows


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize(("stored_tokens", "tokens"), [(9, 0), (700, 0), (700, 513)],
                         ids=["small-inline", "whole", "prefix"])
def test_a_whole_plan_pull_equals_per_item_pulls(transport, stored_tokens, tokens):
    stored = _context(stored_tokens)
    want = tokens or stored_tokens
    items = _plan()
    issuer = TokenIssuer(ttl_s=60)
    order: list[PullItem] = []

    async def body(client, address):
        whole = [_buffer(it, want) for it in items]
        await client.pull(address, PullRequest(context_id="ctx", items=items, token=issuer.issue("ctx")[0], tokens=tokens),
                          whole, lambda it, t: order.append(it), 30)
        single = []
        for it in items:  # each item its own request and grant
            buf = [_buffer(it, want)]
            await client.pull(address, PullRequest(context_id="ctx", items=[it], token=issuer.issue("ctx")[0], tokens=tokens),
                              buf, lambda *a: None, 30)
            single.append(buf[0])
        return whole, single

    whole, single = asyncio.run(_session(transport, issuer, body, stored=stored))
    assert order == items  # delivered in plan order
    for it, a, b in zip(items, whole, single, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), it  # bitwise: both pulls copy the stored bytes
        axis = 1 if it.kind == "E" else 2
        assert torch.equal(a, stored[(it.layer, it.kind)].narrow(axis, 0, want)), it  # bitwise: the channel copies the stored bytes


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize(("stored_tokens", "tokens", "start"), [(9, 0, 4), (700, 0, 189), (700, 513, 2), (2, 0, 1)],
                         ids=["small-inline", "whole", "prefix", "last-token"])
def test_items_from_a_later_token_are_that_token_range(transport, stored_tokens, tokens, start):
    """A sliding-window layer's K / V pulled from `start`: the stored [start, tokens) of each head
    lands, E whole; the placed-memory channels read it in place."""
    stored = _context(stored_tokens)
    want = tokens or stored_tokens
    items = [PullItem(l, "E") for l in E_LAYERS] + [PullItem(l, k, start=start if l % 2 else 0)
                                                    for l in (0, 1, 5, 6, 7) for k in "KV"]
    issuer = TokenIssuer(ttl_s=60)

    async def body(client, address):
        into = [_buffer(it, want - it.start) for it in items]
        await client.pull(address, PullRequest(context_id="ctx", items=items, token=issuer.issue("ctx")[0], tokens=tokens),
                          into, lambda it, t: None, 30)
        return into

    got = asyncio.run(_session(transport, issuer, body, stored=stored))
    for it, t in zip(items, got, strict=True):
        axis = 1 if it.kind == "E" else 2
        # bitwise: the channel copies the stored bytes
        assert torch.equal(t, stored[(it.layer, it.kind)].narrow(axis, it.start, want - it.start)), it


@pytest.mark.parametrize("case", ["at-the-end", "past-the-end", "an-e-item", "a-lowrank-pull", "negative"])
def test_a_start_no_receiver_asks_is_refused_before_a_byte_lands(case):
    issuer = TokenIssuer(ttl_s=60)
    k = PullItem(1, "K", start=9)
    request = {
        "at-the-end": PullRequest(context_id="ctx", items=[k], token=issuer.issue("ctx")[0]),
        "past-the-end": PullRequest(context_id="ctx", items=[PullItem(1, "K", start=5)], token=issuer.issue("ctx")[0],
                                    tokens=4),
        "an-e-item": PullRequest(context_id="ctx", items=[PullItem(2, "E", start=1)], token=issuer.issue("ctx")[0]),
        "a-lowrank-pull": PullRequest(context_id="ctx", items=[PullItem(1, "K", start=1)], token=issuer.issue("ctx")[0],
                                      codec="lowrank"),
        "negative": PullRequest(context_id="ctx", items=[PullItem(1, "K", start=-1)], token=issuer.issue("ctx")[0]),
    }[case]
    into = [torch.full((1, KVH, 9, HD), float("nan"))]
    delivered: list[PullItem] = []

    async def body(client, address):
        await client.pull(address, request, into, lambda it, t: delivered.append(it), 30)

    with pytest.raises((TransferError, BadMessageError), match="start|from token|token 0|codes whole"):
        asyncio.run(_session("inproc", issuer, body, stored=_context(9)))
    assert delivered == [] and torch.isnan(into[0]).all()


def _over_broad(issuer: TokenIssuer) -> dict[str, tuple[PullRequest, type[Exception], str]]:
    plan = _plan()
    return {
        "forged-grant": (PullRequest(context_id="ctx", items=plan, token=TokenIssuer(ttl_s=60).issue("ctx")[0]),
                         TransferError, "unauthorized"),
        "another-contexts-grant": (PullRequest(context_id="ctx", items=plan, token=issuer.issue("other")[0]),
                                   TransferError, "unauthorized"),
        "a-layer-not-held": (PullRequest(context_id="ctx", items=[*plan, PullItem(LAYERS, "K")], token=issuer.issue("ctx")[0]),
                             TransferError, "does not hold"),
        "an-e-not-held": (PullRequest(context_id="ctx", items=[PullItem(3, "E"), *plan], token=issuer.issue("ctx")[0]),
                          TransferError, "does not hold"),
        "more-tokens-than-stored": (PullRequest(context_id="ctx", items=plan, token=issuer.issue("ctx")[0], tokens=10),
                                    TransferError, "context has 9"),
        "repeated-items": (PullRequest(context_id="ctx", items=[*plan, plan[-1]], token=issuer.issue("ctx")[0]),
                           TransferError, "repeated items"),
        "too-many-items": (PullRequest(context_id="ctx", items=[PullItem(i // 3, "KVE"[i % 3]) for i in range(MAX_ITEMS + 1)],
                                       token=issuer.issue("ctx")[0]), TransferError, "items; at most"),
    }


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize("case", ["forged-grant", "another-contexts-grant", "a-layer-not-held", "an-e-not-held",
                                  "more-tokens-than-stored", "repeated-items", "too-many-items"])
def test_a_forged_or_over_broad_plan_is_refused_before_a_byte_lands(transport, case):
    issuer = TokenIssuer(ttl_s=60)
    request, error, match = _over_broad(issuer)[case]
    want = request.tokens or 9
    into = [_buffer(it, want) for it in request.items]
    delivered: list[PullItem] = []

    async def body(client, address):
        await client.pull(address, request, into, lambda it, t: delivered.append(it), 30)

    with pytest.raises((error, BadMessageError), match=match):
        asyncio.run(_session(transport, issuer, body, stored=_context(9)))
    assert delivered == []
    assert all(torch.isnan(b).all() for b in into)  # not a byte written
