"""A bare UCX tensor server for `droidmesh bench transfer`: `python -m shared.bench.tensor_server
SIZE[,SIZE...]` serves one bf16 tensor of each byte size (context id = the size, layer 0, K),
prints its port once listening, and runs until terminated."""

from __future__ import annotations

import asyncio
import signal
import sys

import torch

from shared.transport.ucx import BulkServer


async def serve(sizes: list[int]) -> None:
    tensors = {str(n): torch.randn(n // 2).to(torch.bfloat16) for n in sizes}
    server = BulkServer(lambda cid, layer, kind: tensors.get(cid) if (layer, kind) == (0, "K") else None)
    print(server.start(), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    asyncio.run(serve([int(s) for s in sys.argv[1].split(",")]))
