"""Wiring up a UCX endpoint between a receiver and a sender through a TCP connection.

ucxx 0.52's listener cannot bind a host, so none is used: the server listens on a TCP socket bound
to its configured host only (`ControlListener`). A client connects to it and both sides send one
hello (`_HELLO`: magic, their receive tag, their UCX worker address's size, then the address),
then each creates an endpoint from the other's worker address and the channel's messages flow
over those endpoints. The TCP connection stays open as the endpoint's lifeline: either side
closing it (or dying) aborts the endpoint (`_watch`), and the server counts its connections by it.

What a peer chooses here reaches UCX, which trusts it: a malformed worker address makes UCX abort
the whole process. So a hello is read with its size checked before its bytes, within the caller's
deadline (HELLO_S on the server, the connect deadline on the client), and its worker address is
walked and checked (`ucp_address.check_peer`, against the transports this process runs) before
ucxx sees it. A peer that fails any of it gets `BadMessageError` (the server logs why and closes
that connection; a client's connect fails): nobody else's connection is touched. The tags are
the peer's own choice and harmless: a peer's sends match only the receives of its own endpoint.
Runs on the owning service's event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from typing import Any

import structlog

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport.address import on_this_host, parse_host_port
from droidmesh.shared.transport.ucp_address import MAX_WORKER_ADDRESS, check_peer
from droidmesh.shared.transport.ucx.ops import abort
from droidmesh.shared.transport.ucx.runtime import local_view, ucxx

log = structlog.get_logger("ucx")
# ">4sQI": magic, the sender's receive tag, the worker address's size; then the address.
_HELLO = struct.Struct(">4sQI")
_MAGIC = b"DMU1"
HELLO_S = 5.0  # server: the longest a new connection may take to send its hello


def hello(tag: int) -> bytes:
    address = ucxx().get_worker_address().tobytes()
    return _HELLO.pack(_MAGIC, tag, len(address)) + address


async def read_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[int, bytes]:
    """The peer's (receive tag, worker address), the address checked as UCX will read it;
    `BadMessageError` for anything malformed, the address's size checked before it is read."""
    magic, tag, n = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if magic != _MAGIC or not 0 < n <= MAX_WORKER_ADDRESS:
        raise BadMessageError(f"bad ucx hello (magic {magic!r}, {n}-byte address; at most {MAX_WORKER_ADDRESS})")
    address = await reader.readexactly(n)
    check_peer(address, local_view(), on_this_host(writer.get_extra_info("peername")))
    return tag, address


async def endpoint_to(peer: tuple[int, bytes], tag: int, writer: asyncio.StreamWriter) -> Any:
    """An endpoint to the peer's (checked) worker address, sending with its tag and receiving with
    ours (tagged receives are matched worker-wide, so each connection has random tags of its own),
    tied to the TCP connection: that closing aborts the endpoint, and `abort` closes it."""
    u = ucxx()
    ep = await u.create_endpoint_from_worker_address(u.get_ucx_address_from_buffer(peer[1]))
    ep._tags = {"msg_send": peer[0], "msg_recv": tag}
    ep._droidmesh_link = writer
    return ep


async def watch(reader: asyncio.StreamReader, ep: Any) -> None:
    """Abort `ep` when its TCP connection ends (the peer closed it or died) or carries anything."""
    try:
        await reader.read(1)
    except Exception:
        pass
    abort(ep)


async def connect(address: str) -> Any:
    """Wire up an endpoint to the server at "host:port" (a TCP connect, the hellos, the endpoint),
    watched through its TCP connection (`watch`). No deadline of its own: callers bound it.
    `BadMessageError` (logged) when the server's hello is malformed."""
    host, port = parse_host_port(address, "ucx")
    local_view()  # our own address must be readable before any peer's is trusted to UCX
    reader, writer = await asyncio.open_connection(host, port)
    try:
        tag = secrets.randbits(64)
        writer.write(hello(tag))
        await writer.drain()
        try:
            peer = await read_hello(reader, writer)
        except BadMessageError as e:
            log.warning("ucx_peer_refused", address=address, reason=str(e))
            raise
        ep = await endpoint_to(peer, tag, writer)
    except BaseException:
        writer.close()
        raise
    ep._droidmesh_watch = asyncio.ensure_future(watch(reader, ep))  # referenced while the endpoint is
    return ep
