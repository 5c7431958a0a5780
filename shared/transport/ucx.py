"""The UCX bulk channel (ucxx): one `BulkServer` / `BulkClient` pair over real endpoints.

The protocol and its checks are `shared/transport/bulk.py`'s; this module only moves bytes:
the request and response as UCX object messages, then every payload as one tagged message,
all posted at once in order (UCX matches same-tag messages in order), so the wire stays busy and
there is no per-item round trip. The client keeps one endpoint per sender address and runs one
pull at a time on it; any error drops the endpoint, which is never reused half-read.

ucxx is imported on first use, and UCX is configured through `ucxx.init` options, never by
changing the process environment. `UCX_*` variables set by an operator still win.

Wireup (ucxx 0.52's listener cannot bind a host, so none is used): the server listens on a TCP
socket bound to its configured host only. A client connects to it and both sides send one hello
(`_HELLO`: their receive tag and their UCX worker address, its size checked against
`MAX_WORKER_ADDRESS` before it is read, under HELLO_S), then each creates an endpoint from the
other's worker address and the messages below flow over those endpoints. The TCP connection stays
open as the endpoint's lifeline: either side closing it (or dying) aborts the endpoint, and the
server counts its connections by it. UCX's own tcp transport listens per network device; a
server restricts it to the device(s) holding its configured host (`UCX_NET_DEVICES`, see
`bind_devices`) when it is the first in the process to initialise ucxx.

CUDA tensors (raw codec; the byte-level rules are `codecs.py`'s):
  1. a client whose buffers are all on CUDA asks for device payloads when UCX here can take
     device memory (`capabilities.ucx_cuda_support`); a server that cannot send it drops the ask;
  2. the server hands UCX the stored tensor's own device memory (ucxx takes any object with
     `__cuda_array_interface__`, a torch CUDA tensor among them): with cuda_ipc, the pull is one
     device-to-device copy between the two processes;
  3. the client receives into `codecs.receive_buffer`: its CUDA buffer itself for a device
     payload, else pinned host staging (logged once per process and side, with the reason).
     Before UCX writes into device buffers the client waits, off the loop, for the work queued on
     their device's current stream: the caching allocator may hand out memory that kernels
     queued before the pull still use, and UCX's copies are not ordered with that stream.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import ipaddress
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import torch
from droidmesh.shared.errors import BadMessageError, DroidMeshError, PeerUnreachableError, TransferError
from droidmesh.shared.transport import capabilities, codecs
from droidmesh.shared.transport.bulk import (
    MAX_REQUEST_BYTES,
    Authorize,
    OnItem,
    Pin,
    Served,
    TensorLookup,
    answer,
    as_is,
    guarded_pull,
    landings,
)
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("ucx")
# Listener endpoints always run with peer-failure error handling (ucxx cannot accept a connection
# without it), and under it UCX only takes a transport for zero-copy rendezvous if its memory
# domain can invalidate memory (ucp_wireup.c; "for data integrity in case of error"). CMA's
# domain never claims that, so same-host bulk went through TCP on loopback (and posix/sysv are
# dropped too unless MM_ERROR_HANDLING=y). CMA_MEMORY_INVALIDATE=y only declares the capability,
# which makes rendezvous "zero-copy read from remote" over CMA eligible: the receiver's own thread
# copies the sender's payload into its buffer with process_vm_readv (one copy, no bounce buffer).
# What the missing invalidation could cost after a peer failure is a read of a sender buffer the
# sender already reused; those bytes fail the payload checksum. Measured here between two
# processes: 16-256 MiB 1.1-1.5 GB/s against 0.55-0.62 over tcp/lo (README, bench transfer).
# MM_ERROR_HANDLING=y (sysv fragments for the bulk) is left off: it swung from 0.2 to 3.5 GB/s
# run to run on two busy cores, as each 512 KiB fragment needs both processes scheduled at once.
UCX_OPTIONS = {"TLS": "tcp,sm,self", "CMA_MEMORY_INVALIDATE": "y", "WARN_UNUSED_ENV_VARS": "n"}
# With a GPU, UCX may move device memory itself (cuda_copy; cuda_ipc between processes on one
# node, see capabilities.py). Named only where CUDA exists: UCX warns about absent transports.
CUDA_TLS = "cuda_copy,cuda_ipc"
_ucxx: Any = None
_net_devices: str | None = None  # UCX_NET_DEVICES for ucxx.init, set by the first server (bind_devices)
# Server limits: a connection waits at most IDLE_S for its next request, a pull's response and
# payloads must be taken within SEND_S (else the endpoint is aborted and the pull's hold on the
# store released), and at most control.MAX_CONNECTIONS connections are served at once (more are closed on
# arrival). Per connection the server holds one request frame (<= MAX_REQUEST_BYTES) and one
# pull's payloads (stored tensors, or copies charged to the store's pull budget).
IDLE_S = 600.0
SEND_S = 120.0
# Client limits. ucxx takes ~5 s to report a connect to a closed port, so a connect must have a
# deadline of its own: SUSPECT_CONNECT_S where the address just failed (its endpoint broke, or a
# connect to it failed: a SIGKILLed sender is bypassed within it), CONNECT_S otherwise (a first
# connect to a live sender on a loaded host can take longer than the suspect deadline, and a
# false "unreachable" would open the holder's circuit). For RETRY_AFTER_S after a failed connect
# pulls from that address fail at once instead of each waiting out its own connect. ABORT_NS
# bounds how long an abort may hold the event loop (ucxx's default is 10 s per attempt).
CONNECT_S = 5.0
SUSPECT_CONNECT_S = 0.5
RETRY_AFTER_S = 1.0
ABORT_NS = 200_000_000
# Wireup hello: ">4sQI" (magic, the sender's receive tag, the worker address's size), then the
# address. The server waits at most HELLO_S for a client's hello.
_HELLO = struct.Struct(">4sQI")
_MAGIC = b"DMU1"
MAX_WORKER_ADDRESS = 8192
HELLO_S = 5.0
# Buffer lifetime. A UCX operation writes into (or reads from) its buffer until UCX completes or
# cancels it, which cancelling the Python task awaiting it does not do. So every buffer handed to
# UCX is kept referenced (`_IN_FLIGHT`) by the task running its operation, never cancelled, until
# that operation ends: on an error or a cancelled pull the endpoint is aborted, which makes UCX
# cancel what it still has posted, and only when those operations report back are the buffers let
# go. Freeing a buffer earlier let a resumed sender's bytes land in freed memory (a segfault later).
_IN_FLIGHT: set[asyncio.Task] = set()


def ucx_options() -> dict[str, str]:
    """`UCX_OPTIONS`, plus the CUDA transports on a machine that has a GPU and the network devices
    a server restricted UCX to (`bind_devices`)."""
    options = dict(UCX_OPTIONS)
    if torch.cuda.is_available():
        options["TLS"] = f"{UCX_OPTIONS['TLS']},{CUDA_TLS}"
    if _net_devices:
        options["NET_DEVICES"] = _net_devices
    return options


def ucxx() -> Any:
    """The ucxx module, initialised once with DroidMesh's UCX options."""
    global _ucxx
    if _ucxx is None:
        import ucxx as module

        module.init(options=ucx_options(), env_takes_precedence=True)
        _ucxx = module
    return _ucxx


def host_devices(host: str) -> str | None:
    """The network device(s) holding `host`'s IPv4 address ("lo" for loopback), comma-separated;
    None when that cannot be told (a name that does not resolve to IPv4, IPv6, a wildcard)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the device's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                found.append(name)
    return ",".join(found) or None


def bind_devices(host: str) -> None:
    """Restrict UCX's network transports to the device(s) holding `host` when ucxx is not yet
    initialised (else, or when the devices cannot be told, log that UCX's tcp transport may
    listen on other devices too)."""
    global _net_devices
    devices = host_devices(host)
    if _ucxx is None and devices is not None:
        _net_devices = devices
    if _net_devices is None or _net_devices != devices:
        log.warning("ucx_devices_unrestricted", configured=host, devices=_net_devices or "all",
                    effect="UCX's tcp transport listens on every device it uses; firewall it or use a private network")


def ask_device(request: PullRequest, into: Sequence[torch.Tensor]) -> PullRequest:
    """The request as a client sends it: asking for device payloads when every buffer is on CUDA
    and UCX here takes device memory (else, with CUDA buffers, noting once that it stages)."""
    if request.codec != "raw" or not into or not all(b.device.type == "cuda" for b in into):
        return request
    support = capabilities.ucx_cuda_support()
    if not support.device_memory:
        capabilities.note_staging("receiver", support)
        return request
    return msgspec.structs.replace(request, codec_params={**request.codec_params, codecs.DEVICE_PARAM: "cuda"})


def honour_device(request: PullRequest) -> PullRequest:
    """The request as a server answers it: without the ask for device payloads where UCX here
    cannot send device memory (its CUDA tensors then go as pinned host copies)."""
    if not codecs.asks_device(request.codec_params):
        return request
    support = capabilities.ucx_cuda_support()
    if support.device_memory:
        return request
    if torch.cuda.is_available():  # without CUDA this sender holds no CUDA tensors: nothing is staged
        capabilities.note_staging("sender", support)
    params = {k: v for k, v in request.codec_params.items() if k != codecs.DEVICE_PARAM}
    return msgspec.structs.replace(request, codec_params=params)


def _ucx_buffer(t: torch.Tensor) -> Any:
    """What ucxx sends from or receives into: a CUDA tensor as itself (`__cuda_array_interface__`),
    host memory as a numpy view."""
    return t if t.device.type == "cuda" else t.numpy()


async def _settle(buffers: Sequence[torch.Tensor]) -> None:
    """Wait, on a worker thread, for the work queued so far on each CUDA buffer's current stream."""
    for device in {b.device for b in buffers if b.device.type == "cuda"}:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        await asyncio.to_thread(done.synchronize)


def _op(coro: Any) -> asyncio.Task:
    """Run one UCX operation (its coroutine holds its buffer) as a task nobody cancels: it ends
    when UCX completes or cancels the operation (after an abort), and stays referenced till then."""
    task = asyncio.ensure_future(coro)
    _IN_FLIGHT.add(task)
    task.add_done_callback(_op_done)
    return task


def _op_done(task: asyncio.Task) -> None:
    _IN_FLIGHT.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an aborted operation's error is expected, not worth a warning


def in_flight() -> int:
    """UCX operations still holding a buffer (tests: 0 once every aborted endpoint has reported back)."""
    return len(_IN_FLIGHT)


async def recv(ep: Any, buffer: Any) -> Any:
    """`ep.recv(buffer)`; cancelling the caller leaves the receive (and `buffer`) to `_op`."""
    return await asyncio.shield(_op(ep.recv(buffer)))


async def send(ep: Any, buffer: Any) -> Any:
    return await asyncio.shield(_op(ep.send(buffer)))


async def send_obj(ep: Any, data: bytes) -> None:
    """`ep.send_obj(data)` (length, then bytes), each buffer kept alive as `send` does."""
    await send(ep, array.array("Q", [len(data)]))
    await send(ep, bytearray(data))


def abort(ep: Any) -> None:
    """Abort `ep` (UCX cancels what it has posted; those operations then report back and let go of
    their buffers), waiting at most ABORT_NS on the loop."""
    if ep is not None and getattr(ep, "_ep", None) is not None:
        try:
            ep.abort(period=ABORT_NS)
        except Exception as e:  # an endpoint already torn down by an error: nothing left to abort
            log.debug("ucx_abort_failed", error=repr(e))
    link = getattr(ep, "_droidmesh_link", None)
    if link is not None:
        link.close()  # the peer's lifeline ends with the endpoint


async def recv_frame(ep: Any, cap: int) -> bytes:
    """One `send_obj` message (an 8-byte length, then the bytes), its length checked against
    `cap` before a buffer is allocated for it (ucxx's `recv_obj` allocates whatever the peer
    declares). A message longer than a posted buffer fails in UCX, which allocates nothing."""
    size = array.array("Q", [0])
    await recv(ep, size)
    n = size[0]
    if not 0 < n <= cap:
        raise BadMessageError(f"peer declared a {n}-byte message; at most {cap}")
    data = bytearray(n)
    await recv(ep, data)
    return bytes(data)


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port); `TransferError` for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad ucx address {address!r}; expected host:port")
    return host, int(port)


def _hello(tag: int) -> bytes:
    address = ucxx().get_worker_address().tobytes()
    return _HELLO.pack(_MAGIC, tag, len(address)) + address


async def _read_hello(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The peer's (receive tag, worker address); `BadMessageError` for anything malformed, the
    address's size checked before it is read."""
    magic, tag, n = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if magic != _MAGIC or not 0 < n <= MAX_WORKER_ADDRESS:
        raise BadMessageError(f"bad ucx hello (magic {magic!r}, {n}-byte address; at most {MAX_WORKER_ADDRESS})")
    return tag, await reader.readexactly(n)


async def _endpoint_to(peer: tuple[int, bytes], tag: int, writer: asyncio.StreamWriter) -> Any:
    """An endpoint to the peer's worker address, sending with its tag and receiving with ours
    (tagged receives are matched worker-wide, so each connection has random tags of its own), tied
    to the TCP connection: that closing aborts the endpoint, and `abort` closes it."""
    u = ucxx()
    ep = await u.create_endpoint_from_worker_address(u.get_ucx_address_from_buffer(peer[1]))
    ep._tags = {"msg_send": peer[0], "msg_recv": tag}
    ep._droidmesh_link = writer
    return ep


async def _watch(reader: asyncio.StreamReader, ep: Any) -> None:
    """Abort `ep` when its TCP connection ends (the peer closed it or died) or carries anything."""
    try:
        await reader.read(1)
    except Exception:
        pass
    abort(ep)


async def connect(address: str) -> Any:
    """Wire up an endpoint to the server at "host:port" (a TCP connect, the hellos, the endpoint),
    watched through its TCP connection (`_watch`). No deadline of its own."""
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        tag = secrets.randbits(64)
        writer.write(_hello(tag))
        await writer.drain()
        ep = await _endpoint_to(await _read_hello(reader), tag, writer)
    except BaseException:
        writer.close()
        raise
    ep._droidmesh_watch = asyncio.ensure_future(_watch(reader, ep))  # referenced while the endpoint is
    return ep


class UcxBulkServer:
    """Serves `PullRequest`s from a tensor lookup (the sender's store) over UCX endpoints wired up
    through a TCP socket bound to the configured host (see the module's wireup notes). What
    reaches the port meets the limits above before anything is allocated."""

    transport: Transport = "ucx"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._listener = ControlListener("ucx", self._serve_connection)

    place = staticmethod(as_is)

    async def start(self) -> str:
        """Listen on the configured host only (`ControlListener`); return "host:port"."""
        bind_devices(self._host)
        ucxx()
        address, bound = await self._listener.start(self._host, self._port)
        log.info("ucx_server_started", bound=bound[0], port=bound[1], net_devices=_net_devices or "all")
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ep: Any = None
        try:
            try:
                async with asyncio.timeout(HELLO_S):
                    peer = await _read_hello(reader)
                tag = secrets.randbits(64)
                writer.write(_hello(tag))
                async with asyncio.timeout(HELLO_S):
                    await writer.drain()
                ep = await _endpoint_to(peer, tag, writer)
            except BadMessageError as e:
                log.warning("ucx_connection_dropped", error=str(e))
                return
            except Exception:  # the peer went away or stalled mid-hello
                return
            ep._droidmesh_watch = asyncio.ensure_future(_watch(reader, ep))
            await self._serve_endpoint(ep)
        finally:
            abort(ep)  # closes the TCP connection too, which ends the watch

    async def _serve_endpoint(self, ep: Any) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(IDLE_S):
                        data = await recv_frame(ep, MAX_REQUEST_BYTES)
                except TimeoutError:
                    log.info("ucx_connection_idle", idle_s=IDLE_S)
                    return
                except BadMessageError as e:
                    log.warning("ucx_connection_dropped", error=str(e))
                    return
                except Exception:  # peer closed or died: this endpoint's loop ends, others go on
                    return
                if not await self._serve_request(ep, data):
                    return
        finally:
            abort(ep)

    async def _serve_request(self, ep: Any, data: bytes) -> bool:
        """Answer one request; False when the connection must end (a send failed or timed out:
        the endpoint is aborted before the pull's payloads are let go)."""
        try:
            request = schemas.decode(data, PullRequest)
        except DroidMeshError as e:
            served = Served(schemas.PullResponse(headers=[], error=f"{e.code}: {str(e)[:500]}"), [], lambda: None)
        else:
            served = answer(honour_device(request), self._lookup, self._authorize, self._pin)
        response, payloads, release = served
        try:
            async with asyncio.timeout(SEND_S):
                await send_obj(ep, schemas.encode(response))
                await asyncio.gather(*(send(ep, _ucx_buffer(p)) for p in payloads))
            return True
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.warning("ucx_send_failed", error=f"{type(e).__name__}: {e}", send_s=SEND_S)
            abort(ep)  # UCX cancels the sends; each keeps its payload referenced until it reports back
            if isinstance(e, asyncio.CancelledError):
                raise
            return False
        finally:
            release()

    async def close(self) -> None:
        await self._listener.close()


class UcxBulkClient:
    """Pulls over cached endpoints (one per sender address, one pull at a time each)."""

    transport: Transport = "ucx"

    def __init__(self) -> None:
        self._eps: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._unreachable: dict[str, tuple[float, str]] = {}  # address -> (monotonic time, why) of a failed connect
        self._suspect: set[str] = set()  # addresses whose endpoint broke or whose connect failed

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull `request`'s items into `into`; return the payload bytes received.

        Raises `TransferError` (peer gone, refused, deadline) or `IntegrityError` (header or
        checksum mismatch). On any error the endpoint is dropped, never reused half-read."""
        async def pull() -> int:
            return await self._pull_on(await self._endpoint(address), request, into, on_item)

        # The per-address lock is waited for under the pull's own deadline (`guarded_pull`): pulls
        # queued behind a stalled one fail at their own deadline, not one timeout after another.
        return await guarded_pull(address, timeout_s, self._locks.setdefault(address, asyncio.Lock()), pull,
                                  lambda: self._drop(address))

    async def _pull_on(self, ep: Any, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem) -> int:
        request = ask_device(request, into)
        await send_obj(ep, schemas.encode(request))
        response = schemas.decode(await recv_frame(ep, schemas.MAX_MESSAGE_BYTES), schemas.PullResponse)
        lands = landings(request, response, into)
        await _settle([land.recv for land in lands])
        # Each receive's task holds its buffer until UCX is done with it (see _IN_FLIGHT): on an
        # early exit the caller drops (aborts) the endpoint, and the receives end as cancelled.
        receives = [_op(ep.recv(_ucx_buffer(land.recv))) for land in lands]
        for land, received in zip(lands, receives, strict=True):
            await asyncio.shield(received)  # in order: E first, so the engine can start while the rest streams
            on_item(land.item, land.land())
        return sum(land.header.nbytes for land in lands)

    async def _endpoint(self, address: str) -> Any:
        """The cached endpoint, or a new one connected within CONNECT_S (SUSPECT_CONNECT_S for an
        address that just failed). A closed endpoint (the peer failed) is aborted and replaced;
        an address whose connect failed in the last RETRY_AFTER_S fails at once
        (`PeerUnreachableError`)."""
        ep = self._eps.get(address)
        if ep is not None and not ep.closed:
            return ep
        if ep is not None:
            await self._drop(address)
        failed = self._unreachable.get(address)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_S:
            raise PeerUnreachableError(f"{address} unreachable {time.monotonic() - failed[0]:.2f}s ago: {failed[1]}")
        parse_address(address)
        # The connect runs as its own task: on a timeout it is left to finish and whatever it
        # made is aborted then (a refused TCP connect, a dead sender's, fails at once).
        connecting = asyncio.ensure_future(connect(address))
        limit = SUSPECT_CONNECT_S if address in self._suspect else CONNECT_S
        try:
            ep = await asyncio.wait_for(asyncio.shield(connecting), limit)
        except BaseException as e:
            connecting.add_done_callback(_abort_made)
            why = f"no connection within {limit}s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            if isinstance(e, Exception):
                self._unreachable[address] = (time.monotonic(), why)
                self._suspect.add(address)
                raise PeerUnreachableError(f"connect to {address} failed: {why}") from e
            raise
        self._unreachable.pop(address, None)
        self._suspect.discard(address)
        self._eps[address] = ep
        return ep

    async def _drop(self, address: str) -> None:
        """Abort `address`'s endpoint (it failed, or the client closes): a reconnect is suspect."""
        if self._eps.get(address) is not None:
            self._suspect.add(address)
        abort(self._eps.pop(address, None))

    async def warm(self, address: str) -> None:
        """Connect ahead of the first pull (a fresh endpoint's first transfer is ~3x slower)."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._endpoint(address)

    async def close(self) -> None:
        for address in list(self._eps):
            await self._drop(address)


def _abort_made(connecting: asyncio.Future) -> None:
    """A connect given up on that completed later: abort the endpoint it made."""
    if not connecting.cancelled() and connecting.exception() is None:
        abort(connecting.result())
