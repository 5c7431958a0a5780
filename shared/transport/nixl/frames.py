"""The NIXL channel's control stream: length-prefixed msgpack frames over TCP.

A frame is a 4-byte big-endian length, then one `schemas` message. Its declared length is checked
against a cap (`schemas.MAX_MESSAGE_BYTES` or less) before a byte of it is read, and every read
and send runs under a deadline (the caller's, or SEND_S for a send). Called on the event loop by
both sides of the channel.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from droidmesh.shared.errors import BadMessageError, TransferError
from droidmesh.shared.transport.bulk import MAX_REQUEST_BYTES
from droidmesh.shared.wire import schemas

M = TypeVar("M", bound=schemas.Message)
SEND_S = 30.0  # either side: a control frame must be taken by the peer within this
_HEADER = 4


async def send(writer: asyncio.StreamWriter, msg: schemas.Message) -> None:
    """Send one frame; a peer that does not take it within SEND_S fails the send."""
    data = schemas.encode(msg)
    if len(data) > schemas.MAX_MESSAGE_BYTES:
        raise TransferError(f"{type(msg).__name__} of {len(data)} bytes exceeds {schemas.MAX_MESSAGE_BYTES}")
    writer.write(len(data).to_bytes(_HEADER, "big") + data)
    async with asyncio.timeout(SEND_S):
        await writer.drain()


async def read_frame(reader: asyncio.StreamReader, cap: int = schemas.MAX_MESSAGE_BYTES) -> bytes:
    """One frame's bytes; its declared length is checked against `cap` before reading it."""
    n = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if n > cap:
        raise BadMessageError(f"frame of {n} bytes exceeds {cap}")
    return await reader.readexactly(n)


async def recv(reader: asyncio.StreamReader, kind: type[M], deadline_s: float, cap: int = MAX_REQUEST_BYTES) -> M:
    """One frame decoded as `kind`, within `deadline_s`."""
    async with asyncio.timeout(deadline_s):
        return schemas.decode(await read_frame(reader, cap), kind)
