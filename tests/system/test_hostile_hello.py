"""Hostile peers against real bulk-channel processes, in both directions.

Sender side: a real bulk server process per channel (`python -m droidmesh.shared.tools.bench.tensor_server`,
the channel's own server class) gets malformed connection setups from 127.0.0.1: random bytes,
wrong magic, oversized and zero length prefixes, truncated hellos, a UCX worker address whose
version UCX asserts on, valid prefixes then garbage, flipped bytes, stalled connections, frames
with descriptors attached. Afterwards it must still be alive, serve an honest pull, and have logged
why it dropped those peers. Before the UCX worker address was checked, the first malformed
address killed the sender (SIGABRT inside UCX, exit status -6).

Receiver side: a client process dials a listener that answers with malformed bytes (a UCX hello,
NIXL agent metadata) and must get a Python error for each, never abort. The shm channel parses
no peer bytes in C; its hostile grants are `tests/integration/test_shm_channel.py`'s.

Every loop is bounded in count and time; nothing is timed.
"""

from __future__ import annotations

import array
import asyncio
import os
import random
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from droidmesh.shared.service.launch import Proc
from droidmesh.shared.tools.bench.tensor_server import ADDRESS_PREFIX
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import NixlGrant, NixlRegion, UcxWelcome
from droidmesh.shared.wire.schemas import PullItem, PullRequest, PullResponse, TensorHeader

pytestmark = [pytest.mark.system, pytest.mark.fuzz, pytest.mark.security]

SIZE = 4096  # the one tensor each server holds (bf16, context id "4096", layer 0 K)
FLIPS = 24  # hostile connections with flipped bytes, per channel
IO_S = 20.0  # the longest one hostile exchange may take
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
_HELLO = struct.Struct(">4sQII")  # magic, tag, address size, request size; then both
REQUEST = schemas.encode(PullRequest(context_id=str(SIZE), items=[PullItem(0, "K")]))  # the servers here grant all


@pytest.fixture(scope="module")
def own_address() -> bytes:
    """A real UCX worker address (this process's), the base of the malformed ones."""
    from droidmesh.shared.transport.ucx import ucxx

    return bytes(ucxx().get_worker_address().tobytes())


def _server(transport: str, services: list[Proc]) -> tuple[Proc, str]:
    argv = [sys.executable, "-m", "droidmesh.shared.tools.bench.tensor_server", transport, str(SIZE)]
    proc = Proc(f"bulk-{transport}", argv, env=ENV)
    services.append(proc)
    line = proc.wait_for(lambda l: l.startswith((ADDRESS_PREFIX, "BULK_ERROR=")), 120, "its address")
    if not line.startswith(ADDRESS_PREFIX):
        pytest.skip(f"{transport} channel unavailable here: {line}")
    return proc, line[len(ADDRESS_PREFIX):]


def _exchange(connect: Callable[[], socket.socket], data: bytes, fds: list[int] | None = None) -> bool:
    """Send `data` on a fresh connection (with `fds` attached), then read until the peer closes or
    IO_S passes; a reset is an answer too. False when the connect was refused (the server is gone)."""
    try:
        s = connect()
    except OSError:
        return False
    try:
        with s:
            s.settimeout(IO_S)
            if fds:
                s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            for _ in range(256):  # bounded: at most 256 reads of what the server answers
                if not s.recv(1 << 16):
                    break
    except OSError:
        pass
    return True


def _tcp(address: str) -> Callable[[], socket.socket]:
    host, _, port = address.rpartition(":")
    return lambda: socket.create_connection((host, int(port)), timeout=IO_S)


def _unix(path: str) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    return connect


def _flipped(real: bytes, rnd: random.Random) -> bytes:
    b = bytearray(real)
    for _ in range(rnd.randrange(1, 4)):
        b[rnd.randrange(len(b))] = rnd.randrange(256)
    return bytes(b)


def _hello(address: bytes, n: int | None = None, magic: bytes = b"DMU2", request: bytes = REQUEST) -> bytes:
    return _HELLO.pack(magic, 7, len(address) if n is None else n, len(request)) + address + request


def _welcome(address: bytes, n: int | None = None) -> bytes:
    """A sender's welcome naming `address` (`n`: the length prefix, when it should lie)."""
    data = schemas.encode(UcxWelcome(tag=7, address=address))
    return (len(data) if n is None else n).to_bytes(4, "big") + data


def _abort_bait(real: bytes) -> bytes:
    """`real` with the version nibble UCX asserts on (neither v1 nor v2)."""
    return bytes([real[0] & 0xF0 | 2]) + real[1:]


def _ucx_hellos(real: bytes, rnd: random.Random) -> Iterator[bytes]:
    yield rnd.randbytes(64)
    yield _hello(real, magic=b"XXXX")
    yield _hello(rnd.randbytes(32), n=2**32 - 1)  # a length prefix far past the limit
    yield _hello(b"", n=0)
    yield _hello(real[:len(real) // 2], n=len(real))  # truncated, then closed
    yield _hello(_abort_bait(real))
    yield _hello(real[:12] + rnd.randbytes(len(real) - 12))  # a valid prefix, then garbage
    yield _hello(rnd.randbytes(200))
    for _ in range(FLIPS):
        yield _hello(_flipped(real, rnd))


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _frames(rnd: random.Random) -> Iterator[bytes]:
    """Malformed control frames (the nixl and shm framing)."""
    yield rnd.randbytes(64)
    yield (2**32 - 1).to_bytes(4, "big") + rnd.randbytes(16)  # oversized length prefix
    yield _frame(rnd.randbytes(100))
    yield _frame(REQUEST) + _frame(rnd.randbytes(40))  # a valid start, then garbage
    yield _frame(schemas.encode(PullRequest(context_id="x" * 5000, items=[])))
    for _ in range(FLIPS):
        yield _flipped(_frame(schemas.encode(PullRequest(context_id=str(SIZE), items=[PullItem(0, "K")]))), rnd)


def _honest_pull(transport: str, address: str) -> int:
    async def pull() -> int:
        client = make_client(transport)
        try:
            into = [torch.empty(SIZE // 2, dtype=torch.bfloat16)]
            return await client.pull(address, PullRequest(context_id=str(SIZE), items=[PullItem(0, "K")]), into,
                                     lambda *a: None, 60)
        finally:
            await client.close()

    return asyncio.run(pull())


def _assert_alive(proc: Proc, reachable: bool = True) -> None:
    """The server process is running; when it stopped answering, wait (bounded) for its status."""
    try:
        rc = proc.popen.poll() if reachable else proc.popen.wait(IO_S)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc is None, f"the bulk server process exited with status {rc}:\n{proc.tail()}"


def test_ucx_sender_survives_hostile_hellos(services, own_address):
    """A malformed hello, worker address or length prefix ends only its own connection: the
    sender process lives (exit status -6 before addresses were checked), still serves, and logs why."""
    proc, address = _server("ucx", services)
    connect = _tcp(address)
    stalled = connect()  # says nothing: dropped after the hello deadline
    try:
        for data in _ucx_hellos(own_address, random.Random(1)):
            _assert_alive(proc, _exchange(connect, data))
        assert _honest_pull("ucx", address) == SIZE
        proc.wait_for(lambda l: "ucx_connection_dropped" in l and "unknown version 2" in l, 30, "the abort bait's drop")
        proc.wait_for(lambda l: "ucx_connection_dropped" in l and "bad ucx hello" in l, 30, "a bad header's drop")
        proc.wait_for(lambda l: "ucx_connection_dropped" in l and "no hello within" in l, 60, "the stalled peer's drop")
    finally:
        stalled.close()
    _assert_alive(proc)


@pytest.mark.parametrize("transport", ["nixl", "shm"])
def test_nixl_and_shm_senders_survive_hostile_frames(services, transport):
    """Malformed control frames (and, over shm, descriptors a peer attaches) end only their own
    connection: the sender lives, still serves, and logs why."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12")
    proc, address = _server(transport, services)
    connect = _tcp(address) if transport == "nixl" else _unix(address)
    r, w = os.pipe()
    try:
        for i, data in enumerate(_frames(random.Random(2))):
            _assert_alive(proc, _exchange(connect, data, fds=[r, w] if transport == "shm" and i % 2 else None))
    finally:
        os.close(r)
        os.close(w)
    assert _honest_pull(transport, address) == SIZE
    proc.wait_for(lambda l: f"{transport}_connection_dropped" in l and "exceeds" in l, 30, "the oversized frame's drop")
    _assert_alive(proc)


# -- receivers against a hostile listener ---------------------------------------------------------
CLIENT = """
import asyncio, sys
import torch
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.wire.schemas import PullItem, PullRequest

async def main(transport, address, n):
    for i in range(n):
        client = make_client(transport)
        try:
            into = [torch.empty(2048, dtype=torch.bfloat16)]
            request = PullRequest(context_id="4096", items=[PullItem(0, "K")])
            await client.pull(address, request, into, lambda *a: None, 60)
            print(f"CASE {i} ACCEPTED", flush=True)
        except Exception as e:
            print(f"CASE {i} REFUSED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            await client.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


class HostileListener:
    """A TCP listener on 127.0.0.1 that answers the i-th connection's first message with
    `answers[i]` and then waits for the client to hang up (a thread; bounded by IO_S per read)."""

    def __init__(self, answers: list[bytes], read_first: Callable[[socket.socket], None]):
        self.answers, self.read_first = answers, read_first
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(IO_S * 3)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for answer in self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(IO_S)
                try:
                    self.read_first(conn)
                    conn.sendall(answer)
                    while conn.recv(1 << 16):  # until the client hangs up (or IO_S passes)
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(IO_S * 4)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise OSError("peer closed")
        out += chunk
    return out


def _read_ucx_hello(conn: socket.socket) -> None:
    _, _, n, m = _HELLO.unpack(_read_exactly(conn, _HELLO.size))
    _read_exactly(conn, n + m)


def _read_frame(conn: socket.socket) -> None:
    _read_exactly(conn, int.from_bytes(_read_exactly(conn, 4), "big"))


def _clients_against(transport: str, answers: list[bytes], read_first: Callable[[socket.socket], None]) -> list[str]:
    listener = HostileListener(answers, read_first)
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT, transport, listener.address, str(len(answers))],
                             capture_output=True, text=True, timeout=600, env={**os.environ, **ENV})
    finally:
        listener.close()
    assert out.returncode == 0, f"the {transport} client process exited with status {out.returncode}:\n{out.stderr[-3000:]}"
    cases = [l for l in out.stdout.splitlines() if l.startswith("CASE ")]
    assert len(cases) == len(answers), out.stdout[-3000:]
    return cases


def test_a_ucx_receiver_refuses_hostile_welcomes_without_aborting(own_address):
    """Each malformed welcome a listener answers a hello with fails that pull with a Python error."""
    rnd = random.Random(3)
    answers = [_welcome(_abort_bait(own_address)), _welcome(own_address)[:30],
               _welcome(rnd.randbytes(40), n=2**32 - 1), (5).to_bytes(4, "big") + b"NOPE!",
               _welcome(own_address[:12] + rnd.randbytes(len(own_address) - 12)), _welcome(rnd.randbytes(300))]
    cases = _clients_against("ucx", answers, _read_ucx_hello)
    assert all(" REFUSED " in c for c in cases), cases
    assert "unknown version 2" in cases[0], cases[0]


def _nixl_metadata(conn_info: bytes, backend: bytes = b"UCX", conns: int = 1) -> bytes:
    def field(tag: bytes, data: bytes) -> bytes:
        return tag + len(data).to_bytes(8, "little") + data + b"|"

    return (b"nixlSerDes|" + field(b"Agent", b"droidmesh-hostile") + field(b"Conns", conns.to_bytes(8, "little"))
            + field(b"t", backend) + field(b"c", conn_info) + field(b"", b"MemSection")
            + field(b"nixlSecElms", bytes(8)))


def _grant(md: bytes) -> bytes:
    """A grant of the pull `CLIENT` makes, carrying `md` as its metadata."""
    header = TensorHeader(context_id="4096", layer=0, kind="K", shape=[2048], dtype="bfloat16", codec="raw",
                          codec_params={}, nbytes=SIZE, checksum="")
    return _frame(schemas.encode(NixlGrant(response=PullResponse(headers=[header]), metadata=md,
                                           regions=[NixlRegion(addr=0x7F0000001000, nbytes=SIZE)])))


def test_a_nixl_receiver_refuses_hostile_agent_metadata_without_aborting(own_address):
    """A first grant whose agent metadata carries a UCX worker address UCX would abort on, or is of
    another shape, fails that pull with a Python error."""
    pytest.importorskip("nixl_cu12")
    rnd = random.Random(4)
    mds = [_nixl_metadata(_abort_bait(own_address)), _nixl_metadata(own_address[:12] + rnd.randbytes(64)),
           _nixl_metadata(own_address, backend=b"GDS"), _nixl_metadata(own_address, conns=2**40),
           _nixl_metadata(own_address)[:-9]]
    cases = _clients_against("nixl", [_grant(md) for md in mds], _read_frame)
    assert all(" REFUSED " in c for c in cases), cases
    assert "unknown version 2" in cases[0], cases[0]


# -- what passes the check, UCX takes ------------------------------------------------------------
FEED = """
import asyncio, random, sys
from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport.ucp_address import check_peer
from droidmesh.shared.transport.ucx import ucxx
from droidmesh.shared.transport.ucx.runtime import local_view

async def main(seed, n):
    u, rnd = ucxx(), random.Random(seed)
    own = bytes(u.get_worker_address().tobytes())
    accepted = 0
    for _ in range(n):
        b = bytearray(own)
        for _ in range(rnd.randrange(1, 4)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        cut = rnd.choice([len(b), len(b), rnd.randrange(1, len(b))])
        try:
            check_peer(bytes(b[:cut]), local_view(), True)
        except BadMessageError:
            continue
        accepted += 1
        try:
            ep = await asyncio.wait_for(u.create_endpoint_from_worker_address(u.get_ucx_address_from_buffer(bytes(b[:cut]))), 5)
            ep.abort(period=50_000_000)
        except Exception:
            pass
    print(f"ACCEPTED {accepted}", flush=True)

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def test_worker_addresses_that_pass_the_check_do_not_abort_ucx():
    """Mutations of a real worker address (flipped bytes, truncations) that the check lets through
    go to a real UCX endpoint: the process survives every one (without the check, one aborts it)."""
    out = subprocess.run([sys.executable, "-c", FEED, "5", "400"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **ENV})
    assert out.returncode == 0, f"status {out.returncode}:\n{out.stderr[-3000:]}"
    assert int(out.stdout.split("ACCEPTED ")[1]) > 0
