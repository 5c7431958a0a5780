"""A GPU sender's contexts over the shm channel between two processes (skipped without CUDA): the
sender places a context in one exported device allocation, the receiver opens the export once and
reads every pull device to device; a region past the allocation is refused before any read.

The sender is a child process (`_SENDER` below: a shm server over one placed context, its socket
path on stdout): CUDA IPC cannot open a handle in the process that exported it."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from droidmesh.shared.transport.shm import ShmBulkClient
from droidmesh.shared.wire.schemas import PullItem, PullRequest

pytestmark = pytest.mark.gpu

_SENDER = """
import asyncio, sys, torch
from droidmesh.shared.transport import cuda_ipc
from droidmesh.shared.transport.shm import ShmBulkServer
g = torch.Generator(device="cuda").manual_seed(0)
k, v = (torch.randn(1, 8, 512, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
async def main():
    server = ShmBulkServer(lambda c, l, kind: held.get((l, kind)), None)
    placed = server.place([k, v])
    assert cuda_ipc.exported(placed[0]) is not None, "not exported"
    held.update({(0, "K"): placed[0], (0, "V"): placed[1]})
    print(await server.start(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await server.close()
held = {}
asyncio.run(main())
"""


def test_a_gpu_context_is_read_device_to_device_through_one_mapping():
    sender = subprocess.Popen([sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = sender.stdout.readline().strip()  # type: ignore[union-attr]
        assert address, "the sender did not start"

        async def pulls():
            client = ShmBulkClient()
            try:
                got = []
                for tokens in (0, 100, 0):
                    n = tokens or 512
                    into = [torch.empty(1, 8, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                    await client.pull(address, PullRequest(context_id="c", items=[PullItem(0, "K"), PullItem(0, "V")],
                                                           tokens=tokens), into, lambda *a: None, 30)
                    got.append(into)
                return got, client._conns[address].mappings.opened
            finally:
                await client.close()

        got, opened = asyncio.run(pulls())
        g = torch.Generator(device="cuda").manual_seed(0)
        k, v = (torch.randn(1, 8, 512, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        for into, n in zip(got, (512, 100, 512), strict=True):
            assert torch.equal(into[0], k[:, :, :n]) and torch.equal(into[1], v[:, :, :n])  # bitwise: copied bytes
        assert opened == 1  # one export, opened once for three pulls
    finally:
        sender.stdin.close()  # type: ignore[union-attr]
        sender.wait(timeout=30)
