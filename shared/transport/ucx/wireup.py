"""Wiring up a UCX endpoint between a receiver and a sender's sandbox through a TCP connection.

ucxx 0.52's listener cannot bind a host, so none is used: the server listens on a TCP socket bound
to its configured host only (`ControlListener`). The receiver opens the connection with its first
pull: one hello (`_HELLO`: magic, its receive tag, its UCX worker address's size, the request's
size; then the address and the `PullRequest`). The sender authorizes that request before anything
else; refused, it answers a `UcxWelcome` with the error and nothing of itself. Granted, the
connection's sandbox process (`sandbox/`) checks the receiver's address against its own UCX,
makes the endpoint, and the welcome carries the sandbox's worker address and receive tag; the
first pull's response then comes over the endpoint like every later one's. So no peer learns a
worker address, or can wire an endpoint to anything of the sender's, without a grant, and the
one it reaches is its own connection's sandbox. The TCP connection stays open as the endpoint's
lifeline: either side closing it (or dying) aborts the endpoint (`watch`).

What a peer chooses here reaches UCX, which trusts it: a malformed worker address makes UCX abort
the whole process. So every size is checked before its bytes are read, within the caller's
deadline, and a worker address is walked and checked (`ucp_address.check_peer`, against the
transports the reading process runs) before ucxx sees it: by the sandbox for a receiver's, by
the receiver for a welcome's. The tags are the peer's own choice and harmless: a peer's sends
match only the receives of its own endpoint. Runs on the owning process's event loop.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport.limits import MAX_REQUEST_BYTES
from droidmesh.shared.transport.ucp_address import MAX_WORKER_ADDRESS
from droidmesh.shared.transport.ucx.ops import abort
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import UcxWelcome

# ">4sQII": magic, the receiver's receive tag, its worker address's size, the request's size.
_HELLO = struct.Struct(">4sQII")
_MAGIC = b"DMU2"
_LENGTH = struct.Struct(">I")
MAX_WELCOME_BYTES = MAX_WORKER_ADDRESS + 1024
HELLO_S = 5.0  # server: the longest a new connection may take to send its hello


def hello(tag: int, address: bytes, request: bytes) -> bytes:
    return _HELLO.pack(_MAGIC, tag, len(address), len(request)) + address + request


async def read_hello(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """The receiver's (receive tag, worker address, first request frame), every size checked
    before its bytes are read; `BadMessageError` for anything malformed. The address is not
    checked here: the sandbox that will use it checks it against its own UCX."""
    magic, tag, n, m = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if magic != _MAGIC or not 0 < n <= MAX_WORKER_ADDRESS or not 0 < m <= MAX_REQUEST_BYTES:
        raise BadMessageError(f"bad ucx hello (magic {magic!r}, a {n}-byte address, a {m}-byte request; "
                              f"at most {MAX_WORKER_ADDRESS} and {MAX_REQUEST_BYTES})")
    return tag, await reader.readexactly(n), await reader.readexactly(m)


async def send_welcome(writer: asyncio.StreamWriter, welcome: UcxWelcome) -> None:
    data = schemas.encode(welcome)
    writer.write(_LENGTH.pack(len(data)) + data)
    async with asyncio.timeout(HELLO_S):
        await writer.drain()


async def read_welcome(reader: asyncio.StreamReader) -> UcxWelcome:
    """The sender's welcome, its size checked before it is read (no deadline: callers bound it)."""
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if not 0 < n <= MAX_WELCOME_BYTES:
        raise BadMessageError(f"a {n}-byte ucx welcome; at most {MAX_WELCOME_BYTES}")
    return schemas.decode(await reader.readexactly(n), UcxWelcome)


async def endpoint_to(u: Any, address: bytes, send_tag: int, recv_tag: int, writer: asyncio.StreamWriter) -> Any:
    """An endpoint to a (checked) worker address, sending with `send_tag` and receiving with
    `recv_tag` (tagged receives are matched worker-wide, so each connection has random tags of
    its own), tied to the TCP connection: that closing aborts the endpoint, and `abort` closes it."""
    ep = await u.create_endpoint_from_worker_address(u.get_ucx_address_from_buffer(address))
    ep._tags = {"msg_send": send_tag, "msg_recv": recv_tag}
    ep._droidmesh_link = writer
    return ep


async def watch(reader: asyncio.StreamReader, ep: Any) -> None:
    """Abort `ep` when its TCP connection ends (the peer closed it or died) or carries anything."""
    try:
        await reader.read(1)
    except Exception:
        pass
    abort(ep)
