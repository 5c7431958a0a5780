"""A bare UCX tensor server for `droidmesh bench transfer`: `python -m shared.bench.tensor_server
SIZE[,SIZE...]` serves one bf16 tensor of each byte size (context id = the size, layer 0, K),
prints its UCX address once listening, and runs until terminated."""

from __future__ import annotations

import asyncio
import signal
import sys

import torch

from shared.transport.bulk import make_server


async def serve(sizes: list[int]) -> None:
    tensors = {str(n): torch.randn(n // 2).to(torch.bfloat16) for n in sizes}
    server = make_server("ucx", lambda cid, layer, kind: tensors.get(cid) if (layer, kind) == (0, "K") else None, None)
    print(await server.start(), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    asyncio.run(serve([int(s) for s in sys.argv[1].split(",")]))
