"""The nixl client's posting (`NixlBulkClient._read`) against an in-process agent: one call on the
agent's thread loads, registers and posts every run; runs are delivered in order as they
complete; a failed post fails the pull at that run, posts nothing after it, and everything
registered or in flight is released."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest
import torch

from droidmesh.shared.errors import TransferError
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.bulk import Landing
from droidmesh.shared.transport.nixl import client as nixl_client
from droidmesh.shared.wire.channels import NixlRegion
from droidmesh.shared.wire.schemas import PullItem, TensorHeader


class FakeAgent:
    """Records what runs on its one thread; `read` copies from `memory` (addr -> tensor)."""

    def __init__(self, memory: dict[int, torch.Tensor], fail_at: int | None = None, in_progress: bool = False):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.memory, self.fail_at, self.in_progress = memory, fail_at, in_progress
        self.calls: list[str] = []
        self.posts = 0
        self.released: list[Any] = []
        self.deregistered: list[Any] = []

    def submit(self, fn, *args):
        self.calls.append(fn.__name__)
        return self.pool.submit(fn, *args)

    async def call(self, fn, *args):
        return await asyncio.wrap_future(self.submit(fn, *args))

    def load(self, metadata: bytes) -> str:
        return "peer"

    def register(self, regions):
        return ("registered", len(regions))

    def deregister(self, descs) -> None:
        self.deregistered.append(descs)

    def read(self, local, remote, peer):
        if self.posts == self.fail_at:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.posts += 1
        for (dst, n), (src, _) in zip(local, remote, strict=True):
            _copy(dst, self.memory[src], n)
        return f"handle{self.posts}", "PROC" if self.in_progress else "DONE"

    def state(self, handle) -> str:
        return "DONE"

    def release(self, handle) -> None:
        self.released.append(handle)


_BUFFERS: dict[int, torch.Tensor] = {}


def _copy(dst_addr: int, src: torch.Tensor, n: int) -> None:
    _BUFFERS[dst_addr].copy_(src.reshape(-1).view(torch.uint8)[:n])


def _lands(layers: int) -> tuple[list[Landing], list[NixlRegion], dict[int, torch.Tensor]]:
    lands, regions, memory = [], [], {}
    for layer in range(layers):
        for kind in "KV":
            src = torch.randn(1, 2, 5, 4)
            out = torch.empty_like(src)
            recv = out.view(-1).view(torch.uint8)
            _BUFFERS[recv.data_ptr()] = recv
            memory[src.data_ptr()] = src
            header = TensorHeader(context_id="c", layer=layer, kind=kind, shape=list(src.shape), dtype="float32",
                                  codec="raw", codec_params={}, nbytes=recv.numel(), checksum="")
            lands.append(Landing(PullItem(layer, kind), header, codecs.get("raw"), out, "out", recv))
            regions.append(NixlRegion(addr=src.data_ptr(), nbytes=recv.numel()))
    return lands, regions, memory


async def _pull(agent: FakeAgent, lands, regions, delivered):
    in_flight: list[Any] = []
    registered: list[Any] = []
    client = nixl_client.NixlBulkClient()
    try:
        await client._read(agent, None, b"md", lands, regions, lambda it, t: delivered.append((it, t.clone())),
                           in_flight, registered, "peer")
    finally:
        await agent.call(nixl_client._release_reads, agent, in_flight, registered)


@pytest.fixture
def per_layer(monkeypatch):
    """A READ per layer (these layers are far smaller than READ_BYTES)."""
    monkeypatch.setattr(nixl_client, "READ_BYTES", 1)


@pytest.mark.parametrize("in_progress", [False, True], ids=["done-in-post", "in-progress"])
def test_every_run_is_posted_in_one_agent_call_and_delivered_in_order(in_progress, per_layer):
    lands, regions, memory = _lands(4)
    agent = FakeAgent(memory, in_progress=in_progress)
    delivered: list = []
    asyncio.run(_pull(agent, lands, regions, delivered))
    assert agent.calls.count("post_all") == 1 and agent.posts == 4  # one READ per layer, one thread call
    assert [it for it, _ in delivered] == [land.item for land in lands]
    for (_, t), land in zip(delivered, lands, strict=True):
        assert torch.equal(t, land.out)  # bitwise: the landed buffer itself
    assert agent.deregistered == [("registered", 8)]
    assert len(agent.released) == 4  # each READ's handle, whether done in its post or later


def test_a_failed_post_fails_the_pull_at_its_run_and_posts_nothing_after(per_layer):
    lands, regions, memory = _lands(5)
    agent = FakeAgent(memory, fail_at=2)
    delivered: list = []
    with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND"):
        asyncio.run(_pull(agent, lands, regions, delivered))
    assert [it.layer for it, _ in delivered] == [0, 0, 1, 1]  # the runs before the failed one
    assert agent.posts == 2
    assert agent.deregistered == [("registered", 10)]  # the landing buffers, released all the same


def test_a_failed_read_state_is_a_transfer_error(per_layer):
    lands, regions, memory = _lands(2)
    agent = FakeAgent(memory, in_progress=True)
    agent.state = lambda handle: "ERR"  # type: ignore[method-assign]
    with pytest.raises(TransferError, match=r"NIXL read failed \(ERR\)"):
        asyncio.run(_pull(agent, lands, regions, []))
    assert agent.deregistered == [("registered", 4)] and len(agent.released) >= 1


def test_small_layers_are_gathered_into_reads_after_the_first():
    lands, regions, memory = _lands(6)
    layer_bytes = 2 * regions[0].nbytes
    moves = list(zip(lands, regions, strict=True))
    assert [[land.item.layer for land, _ in b] for b in nixl_client._batches(moves)] == [[0, 0], [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]]
    nixl_client.READ_BYTES, saved = 2 * layer_bytes, nixl_client.READ_BYTES
    try:  # whole layers, gathered until a READ reaches READ_BYTES
        assert [[land.item.layer for land, _ in b] for b in nixl_client._batches(moves)] == [[0, 0], [1, 1, 2, 2], [3, 3, 4, 4], [5, 5]]
    finally:
        nixl_client.READ_BYTES = saved
    agent = FakeAgent(memory)
    delivered: list = []
    asyncio.run(_pull(agent, lands, regions, delivered))
    assert agent.posts == 2 and [it for it, _ in delivered] == [land.item for land in lands]
