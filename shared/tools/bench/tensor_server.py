"""A bare tensor server for `droidmesh bench transfer`:
`python -m droidmesh.shared.tools.bench.tensor_server TRANSPORT SIZE[,SIZE...] [--items N] [--nats URL]`
serves, over the bulk channel `TRANSPORT` (any name `make_server` knows: ucx, nixl, shm, ...), one
context per size (context id = the size) of N bf16 items of that many bytes each (layers 0..N-1,
kind K), placed as a sender places what it stores (`BulkServer.place`, one context at a time).
With `--nats URL` every pull needs a single-use grant, as a sender's do (`tokens.TokenIssuer`),
asked for on `subjects.sender_grant(GRANT_SENDER)` over that NATS server; without, pulls are not
authorized (the channel's own cost only).
Once listening it prints one line `BULK_ADDRESS=<address>`; if the channel cannot start (its
module fails to import, no such transport...) it prints `BULK_ERROR=<one-line reason>` and exits
1. It runs until SIGTERM. Other lines on stdout (UCX writes its logs and `UCX_PROTO_INFO` tables
there) are for the caller to skip or parse.
The old form `python -m droidmesh.shared.tools.bench.tensor_server SIZE[,SIZE...]` still serves over ucx.
`--device cuda[:N]` (default cpu) keeps the tensors on that device (`gpu_transfer.py`); a device
this machine lacks is a `BULK_ERROR` line.
`--grants N` (without `--nats`): every pull needs a single-use grant, and N of them per context
are printed before the address, one line each, `BULK_GRANT=<context id> <grant>` (valid for
GRANT_TTL_S): hostile-peer tests hand some to an attacker and keep others for honest pulls.
`--grant-requests`: also, for each line read on stdin (a context id), one more such line is printed
(a fuzzer's supply of grants for as long as it runs).
`--fill canary`: each context's bytes are its own marker (`canary(context id)`) repeated, so a
reader can tell which context any bytes it got came from."""

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
GRANT_PREFIX = "BULK_GRANT="
GRANT_SENDER = "bench-transfer"  # the sender id whose grant subject the server answers
GRANT_TTL_S = 30.0
PRINTED_GRANT_TTL_S = 600.0


def canary(context_id: str) -> bytes:
    """The marker a `--fill canary` context's bytes repeat."""
    return f"droidmesh-canary-{context_id}|".encode()


def tensors_for(sizes: list[int], device: str | torch.device = "cpu", items: int = 1,
                fill: str = "random") -> dict[str, list[torch.Tensor]]:
    """Per size, `items` bf16 tensors of that many bytes on `device`, keyed by the size as a
    context id (item i is layer i): random, or each context's `canary` repeated."""
    if fill == "canary":
        def marked(n: int) -> torch.Tensor:
            mark = canary(str(n))
            raw = (mark * (n // len(mark) + 1))[:n - n % 2]
            return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).to(device)  # [n // 2]

        return {str(n): [marked(n) for _ in range(items)] for n in sizes}
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


def _printed_grants(contexts: list[str], n: int, on_request: bool) -> Authorize:
    """Print `n` grants per context (`GRANT_PREFIX` lines), and with `on_request` one more per
    context id read on stdin (a thread reads it; grants are issued on the loop); the check that
    pulls meet."""
    import threading

    from droidmesh.shared.transport.tokens import TokenIssuer

    issuer, loop = TokenIssuer(PRINTED_GRANT_TTL_S), asyncio.get_running_loop()

    def grant(cid: str) -> None:
        print(f"{GRANT_PREFIX}{cid} {issuer.issue(cid)[0]}", flush=True)

    for cid in contexts:
        for _ in range(n):
            grant(cid)
    if on_request:
        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(grant, line.strip()[:64])

        threading.Thread(target=read, daemon=True).start()
    return lambda request: issuer.verify(request.context_id, request.token)


async def serve(transport: str, sizes: list[int], device: str = "cpu", items: int = 1, nats_url: str = "",
                grants: int = 0, fill: str = "random", grant_requests: bool = False) -> int:
    nc = None
    try:
        tensors = tensors_for(sizes, resolve_device(device), items, fill)
        authorize: Authorize | None = None
        if nats_url:
            nc, authorize = await _grants(nats_url)
        elif grants or grant_requests:
            authorize = _printed_grants(list(tensors), grants, grant_requests)
        server = start_server(transport, tensors, authorize=authorize)
        for held in tensors.values():  # as a sender stores them: a context's items at once; in place (the lookup reads this dict)
            held[:] = server.place(held)
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
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.tensor_server")
    parser.add_argument("what", nargs="+", metavar="[TRANSPORT] SIZES")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=1)
    parser.add_argument("--nats", default="")
    parser.add_argument("--grants", type=int, default=0)
    parser.add_argument("--grant-requests", action="store_true")
    parser.add_argument("--fill", choices=("random", "canary"), default="random")
    args = parser.parse_args(argv)
    if len(args.what) > 2:
        parser.error("expected [TRANSPORT] SIZES")
    if args.items < 1:
        parser.error("--items must be at least 1")
    what = args.what if len(args.what) == 2 else ["ucx", *args.what]  # the old form: sizes only
    transport, sizes = what[0], [int(s) for s in what[1].split(",")]
    return asyncio.run(serve(transport, sizes, args.device, args.items, args.nats, args.grants, args.fill,
                             args.grant_requests))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
