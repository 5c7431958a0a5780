"""The NIXL channel's sender side (`NixlBulkServer`): grants pulls as NIXL metadata of a sandbox
process the receiver's agent reads from.

Per connection (its own task on the sender's event loop, `ControlListener`, which admits it to a
slot first: `slots.py`), a loop of:
  1. `PullRequest` (the wait for it bounded by the slot: the setup deadline from the connect until
     a pull completes, then the idle timeout; an idle connection's slot may go to a newcomer
     meanwhile). The sender authorizes and answers it (`answer.answer_async`). A refusal is a `NixlGrant`
     with the error and nothing else: a peer learns nothing of the sender (no agent, no address,
     no memory) before it has shown a grant;
  2. granted: the connection's sandbox process (`sandbox/`, taken on its first grant) maps the
     payloads' memfds (`sandbox.regions`: a placed context where it lies, any other payload in a
     per-pull copy), registers them with its own NIXL agent and answers their addresses and
     metadata (with the agent's connection info on the connection's first grant), sent on as
     the `NixlGrant`;
  3. `NixlDone` (within HOLD_S): the sandbox deregisters and unmaps them, and the pull's hold is
     released; the connection is proven (`Slot.pulled`). A dropped connection ends its sandbox.
The sender's own process never runs NIXL: whatever a peer makes the library do (a READ of any
address, a crash) reaches its connection's sandbox only (the trust model: `sandbox/__init__.py`,
docs/security.md). A receiver's frames are msgpack messages, bounded before they are read, and a
bad one ends that connection (logged), never the server.
"""

from __future__ import annotations

import asyncio
import itertools

import structlog

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.transport import memfd
from droidmesh.shared.transport.answer import Served, answer_async, refusal
from droidmesh.shared.transport.bulk import MAX_REQUEST_BYTES, Authorize, Pin, TensorLookup
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.nixl import frames
from droidmesh.shared.transport.sandbox.host import Sandbox, SandboxPool
from droidmesh.shared.transport.sandbox.regions import export_async, host_only
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import NixlDone, NixlGrant, NixlRegion
from droidmesh.shared.wire.sandbox import SandboxMapped, SandboxRelease, SandboxServe
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("nixl")
HOLD_S = 120.0  # the longest a grant is held before its NixlDone
MAP_S = 30.0  # a sandbox's mapping and registration of one grant


class NixlBulkServer:
    """Grants `PullRequest`s from a tensor lookup (the sender's store) for NIXL reads."""

    transport: Transport = "nixl"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None, limits: SlotLimits | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._listener = ControlListener("nixl", self._serve_connection, limits)
        self.slots = self._listener.slots
        self.sandboxes = SandboxPool("nixl")
        self._pulls = itertools.count()

    place = staticmethod(memfd.place)  # one sealed memfd per stored context: a sandbox maps only those it is granted

    async def start(self) -> str:
        """Start the first sandbox (NIXL must run here), then listen on the configured host only
        (`ControlListener`); return "host:port"."""
        memfd.raise_fd_limit()
        await self.sandboxes.start()
        address, bound = await self._listener.start(self._host, self._port)
        log.info("nixl_server_started", bound=bound[0], port=bound[1])
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        sandbox: Sandbox | None = None
        try:
            while True:
                async with slot.waiting():
                    data = await frames.read_frame(reader, MAX_REQUEST_BYTES)
                served = await _answer(data, self._lookup, self._authorize, self._pin)
                try:
                    slot.claim(served.grantee)  # "" for a refusal: nothing to claim
                    if served.response.error:
                        await frames.send(writer, NixlGrant(response=served.response))
                        continue
                    if sandbox is None:
                        sandbox = await self.sandboxes.take()
                    await self._grant(sandbox, served, reader, writer)
                    slot.pulled()
                finally:
                    served.release()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the receiver closed or dropped the connection: what it held is released above
        except SlotEnded:
            raise  # its deadline passed or a newcomer took its slot: counted and logged there
        except Exception as e:  # a bad peer, a failed or dead sandbox: this connection ends, never the server
            log.warning("nixl_connection_dropped", peer=str(writer.get_extra_info("peername")),
                        error=f"{type(e).__name__}: {e}"[:300])
        finally:
            if sandbox is not None:
                self.sandboxes.give_back(sandbox)

    async def _grant(self, sandbox: Sandbox, served: Served, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        """One granted pull: its payloads registered in the sandbox, the grant sent, its
        NixlDone awaited, the sandbox's registrations released."""
        exported = await export_async(served.payloads)  # `served` (its payloads: the memfds' views) lives till the end
        pull_id = next(self._pulls)
        try:
            await sandbox.send(SandboxServe(pull_id=pull_id, response=b"", regions=exported.regions, fds=len(exported.fds)),
                               exported.fds)
            mapped = await sandbox.recv(SandboxMapped, MAP_S)
            nbytes = [r.nbytes for r in exported.regions]
            await frames.send(writer, NixlGrant(response=served.response, metadata=mapped.metadata,
                                                regions=[NixlRegion(addr=a, nbytes=n) for a, n in zip(mapped.addrs, nbytes, strict=True)]))
            await frames.recv(reader, NixlDone, HOLD_S)
            await sandbox.send(SandboxRelease(pull_id=pull_id))
        finally:
            exported.close()

    async def close(self) -> None:
        await self._listener.close()
        await self.sandboxes.close()


async def _answer(data: bytes, lookup: TensorLookup, authorize: Authorize | None, pin: Pin | None) -> Served:
    """`answer_async` of one request frame (no checksums: a READ copies the sender's own
    memory); a malformed frame is a refusal."""
    try:
        request = schemas.decode(data, PullRequest)
    except DroidMeshError as e:
        return Served(refusal(e), [], lambda: None)
    return await answer_async(host_only(request), lookup, authorize, pin, checksums=False)
