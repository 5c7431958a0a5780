"""A bare tensor server for `droidmesh bench transfer`:
`python -m droidmesh.shared.bench.tensor_server TRANSPORT SIZE[,SIZE...]` serves, over the bulk channel
`TRANSPORT` (any name `make_server` knows: ucx, nixl, shm, ...), one bf16 tensor of each byte size
(placed as a sender places what it stores: `BulkServer.place`)
(context id = the size, layer 0, K). Once listening it prints one line `BULK_ADDRESS=<address>`;
if the channel cannot start (its module fails to import, no such transport...) it prints
`BULK_ERROR=<one-line reason>` and exits 1. It runs until SIGTERM. Other lines on stdout (UCX
writes its logs and `UCX_PROTO_INFO` tables there) are for the caller to skip or parse.
The old form `python -m droidmesh.shared.bench.tensor_server SIZE[,SIZE...]` still serves over ucx.
`--device cuda[:N]` (default cpu) keeps the tensors on that device (`gpu_transfer.py`); a device
this machine lacks is a `BULK_ERROR` line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import torch

from droidmesh.shared.model.device import resolve_device
from droidmesh.shared.transport.bulk import BulkServer, make_server

ADDRESS_PREFIX = "BULK_ADDRESS="
ERROR_PREFIX = "BULK_ERROR="


def tensors_for(sizes: list[int], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One bf16 tensor of each byte size on `device`, keyed by the size as a context id."""
    return {str(n): torch.randn(n // 2, device=device).to(torch.bfloat16) for n in sizes}


def start_server(transport: str, tensors: dict[str, torch.Tensor], name: str = "") -> BulkServer:
    return make_server(transport, lambda cid, layer, kind: tensors.get(cid) if (layer, kind) == (0, "K") else None,
                       None, name=name)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def serve(transport: str, sizes: list[int], device: str = "cpu") -> int:
    try:
        tensors = tensors_for(sizes, resolve_device(device))
        server = start_server(transport, tensors)
        tensors.update(zip(tensors, server.place(list(tensors.values())), strict=True))  # as a sender stores them
        address = await server.start()
    except Exception as e:  # any failure to start is reported as one line
        print(ERROR_PREFIX + one_line(e), flush=True)
        return 1
    print(ADDRESS_PREFIX + address, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.bench.tensor_server")
    parser.add_argument("what", nargs="+", metavar="[TRANSPORT] SIZES")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if len(args.what) > 2:
        parser.error("expected [TRANSPORT] SIZES")
    what = args.what if len(args.what) == 2 else ["ucx", *args.what]  # the old form: sizes only
    transport, sizes = what[0], [int(s) for s in what[1].split(",")]
    return asyncio.run(serve(transport, sizes, args.device))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
