"""The UCX channel's sender side: serves `PullRequest`s over UCX endpoints of sandbox processes
(`UcxBulkServer`).

Per connection (its own task on the sender's event loop, `ControlListener`):
  1. the hello (`wireup.py`), with the connection's first `PullRequest`, within HELLO_S (and the
     slot's setup deadline); that request is authorized and answered (`answer.answer_async`) before
     anything else: refused, the welcome carries the error and nothing else, and the peer may
     say hello again within its slot's setup deadline;
  2. granted: the connection's sandbox (`sandbox/`: the spare a `SandboxPool` keeps started) checks
     the receiver's worker address against its own UCX and makes the endpoint; the welcome names
     the sandbox's worker address and tag;
  3. per pull, the sender hands the sandbox the response and the payloads' memfds
     (`sandbox.regions`), which it sends over the endpoint within SEND_S; the sandbox passes up
     the receiver's next request frame, unread, which the sender answers the same way. The wait
     for it is bounded by the slot: until it completes a pull, a connection lives at most the
     setup deadline; after, it waits at most the idle timeout; per source address and in all, at
     most the configured connections, an idle one's slot going to a newcomer when needed.
The sender's own process never runs UCX: what a peer makes the library do (an endpoint from a
foreign UCX, a GET of any address, an abort) reaches its connection's sandbox only, whose death
ends that connection (logged with its exit status) and nothing else. The TCP connection is the
lifeline: its end ends the sandbox (during a pull, once the sandbox reports its sends or LEFT_S
passes: `_Lifeline`). Per connection the sender holds one request frame
(<= MAX_REQUEST_BYTES) and one pull's payloads (memfds of stored contexts, or copies charged to
the store's pull budget).

CUDA stores: payloads reach the sandbox as host copies (the sandbox maps memfds only), so device
memory never goes to UCX as it is on this channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator

import structlog

from droidmesh.shared.errors import BadMessageError, DroidMeshError
from droidmesh.shared.transport import memfd
from droidmesh.shared.transport.address import on_this_host
from droidmesh.shared.transport.answer import Served, answer_async, refusal
from droidmesh.shared.transport.bulk import Authorize, Pin, TensorLookup
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.sandbox.child import SEND_S
from droidmesh.shared.transport.sandbox.host import Sandbox, SandboxDied, SandboxPool
from droidmesh.shared.transport.sandbox.regions import export_async, host_only
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits
from droidmesh.shared.transport.ucx import runtime, wireup
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import UcxWelcome
from droidmesh.shared.wire.sandbox import SandboxAsk, SandboxServe, SandboxServed, SandboxWire, SandboxWired
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("ucx")
WIRE_S = 30.0  # a sandbox's check of the receiver's address and its endpoint
LEFT_S = 5.0  # after the receiver went mid-pull, how long its sandbox's sends may still report completion


class _Lifeline:
    """The receiver's TCP connection: its end (or anything sent on it) ends the connection's sandbox.

    UCX orders nothing between that connection and the endpoint. A receiver whose last receive
    completed may close it before the sandbox reports its sends complete: a rendezvous send
    completes only when the receiver's acknowledgement reaches the sandbox's worker, and the
    report then crosses the sandbox's loop and socket. So an end during a pull leaves the sandbox
    LEFT_S to report; sends that have not completed by then are ended with it."""

    def __init__(self, reader: asyncio.StreamReader, sandbox: Sandbox):
        self._sandbox = sandbox
        self._pulling = False
        self._grace: asyncio.TimerHandle | None = None
        self._read = asyncio.ensure_future(reader.read(1))
        self._read.add_done_callback(self._ended)

    def ended(self) -> bool:
        return self._read.done()

    def _ended(self, _: asyncio.Future) -> None:
        if self._pulling:
            self._grace = asyncio.get_running_loop().call_later(LEFT_S, self._sandbox.kill)
        else:
            self._sandbox.kill()

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """Around one pull's send: an end meanwhile kills the sandbox only after LEFT_S, or when
        the pull is over, whichever comes first."""
        self._pulling = True
        try:
            yield
        finally:
            self._pulling = False
            if self._grace is not None:
                self._grace.cancel()
            if self.ended():
                self._sandbox.kill()

    def close(self) -> None:
        self._read.cancel()
        if self._grace is not None:
            self._grace.cancel()


class UcxBulkServer:
    """Serves `PullRequest`s from a tensor lookup (the sender's store) over UCX endpoints of
    sandbox processes, wired up through a TCP socket bound to the configured host."""

    transport: Transport = "ucx"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None, limits: SlotLimits | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._listener = ControlListener("ucx", self._serve_connection, limits)
        self.slots = self._listener.slots
        self.sandboxes: SandboxPool | None = None
        self._pulls = itertools.count()

    place = staticmethod(memfd.place)  # one sealed memfd per stored context: a sandbox maps only those it is granted

    async def start(self) -> str:
        """Start the first sandbox (UCX must run here), then listen on the configured host only
        (`ControlListener`); return "host:port"."""
        memfd.raise_fd_limit()
        runtime.bind_devices(self._host)
        self.sandboxes = SandboxPool("ucx", runtime.ucx_options())
        await self.sandboxes.start()
        address, bound = await self._listener.start(self._host, self._port)
        log.info("ucx_server_started", bound=bound[0], port=bound[1], net_devices=runtime.net_devices())
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        peer = writer.get_extra_info("peername")
        sandbox: Sandbox | None = None
        lifeline: _Lifeline | None = None
        try:
            hello_s: float | None = wireup.HELLO_S
            while True:  # a refused peer may say hello again (within its slot's setup deadline)
                try:
                    async with slot.waiting(), asyncio.timeout(hello_s):
                        tag, address, first = await wireup.read_hello(reader)
                except TimeoutError:
                    log.warning("ucx_connection_dropped", peer=str(peer), reason=f"no hello within {hello_s}s")
                    return
                served = await self._answer(first)
                if not served.response.error:
                    break
                await wireup.send_welcome(writer, UcxWelcome(error=served.response.error))
                hello_s = None
            try:
                assert self.sandboxes is not None  # connections are accepted only after start()
                sandbox = await self.sandboxes.take()
                await sandbox.send(SandboxWire(tag=tag, address=address, on_this_host=on_this_host(peer)))
                wired = await sandbox.recv(SandboxWired, WIRE_S)
                await wireup.send_welcome(writer, UcxWelcome(tag=wired.tag, address=wired.address))
            except BaseException:
                served.release()
                raise
            lifeline = _Lifeline(reader, sandbox)
            while True:
                await self._serve_pull(sandbox, served, slot, lifeline)
                async with slot.waiting():
                    ask = await sandbox.recv(SandboxAsk, None)
                served = await self._answer(ask.request)
        except SlotEnded:
            raise
        except Exception as e:  # a bad peer, a failed or dead sandbox: this connection ends, never the server
            if lifeline is None or not lifeline.ended():  # else the receiver went (a cut send is logged as such)
                log.warning("ucx_connection_dropped", peer=str(peer), reason=f"{type(e).__name__}: {e}"[:300])
        finally:
            if lifeline is not None:
                lifeline.close()
            if sandbox is not None and self.sandboxes is not None:
                self.sandboxes.give_back(sandbox)

    async def _serve_pull(self, sandbox: Sandbox, served: Served, slot: Slot, lifeline: _Lifeline) -> None:
        """One answered request: the sandbox sends its response and payloads within SEND_S (a
        pull sent in full proves the connection: `slot.pulled`); the hold is released after."""
        try:
            slot.claim(served.grantee)
            exported = await export_async(served.payloads)  # `served` (its payloads: the memfds' views) lives till the end
            try:
                pull_id = next(self._pulls)
                with lifeline.pulling():
                    await sandbox.send(SandboxServe(pull_id=pull_id, response=schemas.encode(served.response),
                                                    regions=exported.regions, fds=len(exported.fds)), exported.fds)
                    done = await sandbox.recv(SandboxServed, SEND_S + 10.0)  # the sandbox's own deadline reports first
            except SandboxDied as e:
                if e.ended_by_us:  # by the lifeline: the receiver left with sends still unfinished
                    log.warning("ucx_send_failed", error="cancelled: the receiver went mid-pull; its sandbox ended")
                raise
            finally:
                exported.close()
            if done.error:
                # after the receiver left, UCX fails the sends it had not completed with its own error
                error = f"cancelled: the receiver went mid-pull ({done.error})" if lifeline.ended() else done.error
                log.warning("ucx_send_failed", error=error[:300], send_s=SEND_S)
                raise BadMessageError(f"sending the pull failed: {done.error}")
            if not served.response.error:
                slot.pulled()
        finally:
            served.release()

    async def _answer(self, data: bytes) -> Served:
        """`answer_async` of one request frame; a malformed frame is a refusal. Device payloads
        are never asked of a sandbox (it maps host memfds only)."""
        try:
            request = schemas.decode(data, PullRequest)
        except DroidMeshError as e:
            return Served(refusal(e), [], lambda: None)
        return await answer_async(host_only(request), self._lookup, self._authorize, self._pin)

    async def close(self) -> None:
        await self._listener.close()
        if self.sandboxes is not None:
            await self.sandboxes.close()
