"""`ChannelClient.pull` retries once, on a fresh connection, only when a cached connection fails
before anything landed (the sender closed it as idle): never after data, never on the peer's
integrity or format errors, never on a fresh connection."""

from __future__ import annotations

import asyncio

import pytest
import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.transport.client import ChannelClient
from droidmesh.shared.wire.schemas import PullItem, PullRequest

ITEM = PullItem(kind="k", layer=0)
REQUEST = PullRequest(context_id="c", items=[ITEM], token="t")


class Scripted(ChannelClient[int]):
    """Connection n runs `script[n]`: an exception raised before or after one item lands, or success."""

    transport = "inproc"

    def __init__(self, script: list[tuple[bool, BaseException | None]]):
        super().__init__()
        self.script = script
        self.connects = 0

    async def _connect(self, address: str) -> int:
        self.connects += 1
        return self.connects - 1

    def _alive(self, conn: int) -> bool:
        return True  # the close is only noticed when the pull fails

    async def _disconnect(self, address: str, conn: int) -> None:
        pass

    async def _pull_on(self, conn, request, into, on_item) -> int:
        lands_first, error = self.script[conn]
        if lands_first:
            on_item(ITEM, into[0])
        if error is not None:
            raise error
        if not lands_first:
            on_item(ITEM, into[0])
        return 4


def _pull(client: Scripted, warm: bool) -> int:
    async def go() -> int:
        if warm:
            await client.warm("a")
        return await client.pull("a", REQUEST, [torch.zeros(1)], lambda i, t: None, 5.0)

    return asyncio.run(go())


def test_a_warmed_connection_closed_by_the_sender_is_replaced_once():
    client = Scripted([(False, ConnectionResetError("closed by peer")), (False, None)])
    assert _pull(client, warm=True) == 4 and client.connects == 2


@pytest.mark.parametrize("case", [
    ("data landed before the failure", True, (True, ConnectionResetError("reset")), TransferError),
    ("the peer's integrity error", True, (False, IntegrityError("checksum")), IntegrityError),
    ("a fresh connection", False, (False, ConnectionResetError("reset")), TransferError),
], ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_no_retry_after_data_on_peer_errors_or_on_a_fresh_connection(case):
    _, warm, first, raised = case
    client = Scripted([first, (False, None)])
    with pytest.raises(raised):
        _pull(client, warm=warm)
    assert client.connects == 1
