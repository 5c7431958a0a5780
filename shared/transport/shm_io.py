"""Frames over a non-blocking Unix stream socket, with descriptors attached (the shm channel's
control stream): a 4-byte big-endian length, then that many bytes of one message. Called on the
event loop by `shm.py`; every call awaits readiness, never blocks the loop, and has no deadline
of its own (callers bound it).

Descriptors ride with a frame's first bytes (SCM_RIGHTS). `recv_frame` takes at most `max_fds`
of them and only with the length prefix: the kernel closes any a peer attaches beyond that, or to
later bytes (they are read without room for descriptors), so a peer cannot make us hold more.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket

from droidmesh.shared.errors import BadMessageError

_HEADER = 4


async def _ready(sock: socket.socket, writable: bool = False) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    def wake() -> None:
        if not done.done():
            done.set_result(None)

    add(sock.fileno(), wake)
    try:
        await done
    finally:
        remove(sock.fileno())


async def send_frame(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """Send one frame with `fds` attached to its first byte."""
    frame = len(data).to_bytes(_HEADER, "big") + data
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while True:
        try:
            sent = sock.sendmsg([frame], ancillary)
            break
        except BlockingIOError:
            await _ready(sock, writable=True)
    if sent < len(frame):
        await asyncio.get_running_loop().sock_sendall(sock, frame[sent:])


async def recv_frame(sock: socket.socket, cap: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One frame's bytes and the descriptors that came with it (the caller closes them). The
    declared length is checked against `cap` before the body is read; more than `max_fds`
    descriptors is a `BadMessageError` (all of them closed). `EOFError` when the peer closed."""
    head, fds = b"", []
    try:
        while len(head) < _HEADER:
            try:
                room = socket.CMSG_SPACE(max_fds * 4) if max_fds and not head else 0  # only with the first bytes
                data, ancillary, flags, _ = sock.recvmsg(_HEADER - len(head), room)
            except BlockingIOError:
                await _ready(sock)
                continue
            for level, kind, payload in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds += array.array("i", payload[:len(payload) - len(payload) % 4]).tolist()
            if room and flags & socket.MSG_CTRUNC:
                raise BadMessageError(f"a frame with more than {max_fds} descriptors")
            if not data:
                raise EOFError("peer closed the connection")
            head += data
        n = int.from_bytes(head, "big")
        if n > cap:
            raise BadMessageError(f"frame of {n} bytes exceeds {cap}")
        body = bytearray(n)
        view, got, loop = memoryview(body), 0, asyncio.get_running_loop()
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if not k:
                raise EOFError("peer closed the connection")
            got += k
        return bytes(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def alive(sock: socket.socket) -> bool:
    """Whether the peer still holds the connection open (no data is pending on an idle one)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
