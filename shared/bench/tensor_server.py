"""A bare tensor server for `droidmesh bench transfer`:
`python -m droidmesh.shared.bench.tensor_server TRANSPORT SIZE[,SIZE...] [--items N] [--nats URL]`
serves, over the bulk channel `TRANSPORT` (any name `make_server` knows: ucx, nixl, shm, ...), one
context per size (context id = the size) of N bf16 items of that many bytes each (layers 0..N-1,
kind K), placed as a sender places what it stores (`BulkServer.place`, all at once).
With `--nats URL` every pull needs a single-use grant, as a sender's do (`tokens.TokenIssuer`),
asked for on `subjects.sender_grant(GRANT_SENDER)` over that NATS server; without, pulls are not
authorized (the channel's own cost only).
Once listening it prints one line `BULK_ADDRESS=<address>`; if the channel cannot start (its
module fails to import, no such transport...) it prints `BULK_ERROR=<one-line reason>` and exits
1. It runs until SIGTERM. Other lines on stdout (UCX writes its logs and `UCX_PROTO_INFO` tables
there) are for the caller to skip or parse.
The old form `python -m droidmesh.shared.bench.tensor_server SIZE[,SIZE...]` still serves over ucx.
`--device cuda[:N]` (default cpu) keeps the tensors on that device (`gpu_transfer.py`); a device
this machine lacks is a `BULK_ERROR` line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import torch

from droidmesh.shared.model.device import resolve_device
from droidmesh.shared.transport.bulk import Authorize, BulkServer, make_server

ADDRESS_PREFIX = "BULK_ADDRESS="
ERROR_PREFIX = "BULK_ERROR="
GRANT_SENDER = "bench-transfer"  # the sender id whose grant subject the server answers
GRANT_TTL_S = 30.0


def tensors_for(sizes: list[int], device: str | torch.device = "cpu", items: int = 1) -> dict[str, list[torch.Tensor]]:
    """Per size, `items` bf16 tensors of that many bytes on `device`, keyed by the size as a
    context id (item i is layer i)."""
    return {str(n): [torch.randn(n // 2, device=device).to(torch.bfloat16) for _ in range(items)] for n in sizes}


def start_server(transport: str, tensors: dict[str, list[torch.Tensor]], name: str = "",
                 authorize: Authorize | None = None) -> BulkServer:
    def lookup(cid: str, layer: int, kind: str) -> torch.Tensor | None:
        held = tensors.get(cid, [])
        return held[layer] if kind == "K" and 0 <= layer < len(held) else None

    return make_server(transport, lookup, authorize, name=name)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _grants(nats_url: str) -> tuple[Any, Authorize]:
    """Answer grant requests on NATS as a sender does; (the connection, the pull check)."""
    import nats

    from droidmesh.shared.transport.tokens import TokenIssuer
    from droidmesh.shared.wire import schemas, subjects

    issuer = TokenIssuer(GRANT_TTL_S)
    nc = await nats.connect(nats_url)

    async def on_request(msg: Any) -> None:
        req = schemas.decode(msg.data, schemas.GrantRequest)
        token, expires = issuer.issue(req.context_id)
        await msg.respond(schemas.encode(schemas.GrantReply(token=token, expires_at=expires)))

    await nc.subscribe(subjects.sender_grant(GRANT_SENDER), cb=on_request)
    await nc.flush()
    return nc, lambda request: issuer.verify(request.context_id, request.token)


async def serve(transport: str, sizes: list[int], device: str = "cpu", items: int = 1, nats_url: str = "") -> int:
    nc = None
    try:
        tensors = tensors_for(sizes, resolve_device(device), items)
        authorize: Authorize | None = None
        if nats_url:
            nc, authorize = await _grants(nats_url)
        server = start_server(transport, tensors, authorize=authorize)
        flat = [t for held in tensors.values() for t in held]
        placed = iter(server.place(flat))  # as a sender stores them: every item at once
        for held in tensors.values():  # in place: the server's lookup reads this dict
            held[:] = [next(placed) for _ in held]
        address = await server.start()
    except Exception as e:  # any failure to start is reported as one line
        print(ERROR_PREFIX + one_line(e), flush=True)
        return 1
    print(ADDRESS_PREFIX + address, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()
    if nc is not None:
        await nc.close()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.bench.tensor_server")
    parser.add_argument("what", nargs="+", metavar="[TRANSPORT] SIZES")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=1)
    parser.add_argument("--nats", default="")
    args = parser.parse_args(argv)
    if len(args.what) > 2:
        parser.error("expected [TRANSPORT] SIZES")
    if args.items < 1:
        parser.error("--items must be at least 1")
    what = args.what if len(args.what) == 2 else ["ucx", *args.what]  # the old form: sizes only
    transport, sizes = what[0], [int(s) for s in what[1].split(",")]
    return asyncio.run(serve(transport, sizes, args.device, args.items, args.nats))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
