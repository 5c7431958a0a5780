"""The UCX channel's sender side: serves `PullRequest`s over UCX endpoints (`UcxBulkServer`).

Per connection (its own task on the sender's event loop, `ControlListener`): the wireup
(`wireup.py`: the client's hello checked, ours sent, an endpoint made), then a loop of one request
frame -> one `PullResponse` and the payloads, each a tagged message, all posted at once in order.
What reaches the port meets the limits below before anything is allocated:
  - its slot (`slots.py`, through `ControlListener`): until it completes a pull, a connection
    lives at most the setup deadline (its hello and first request included); after, it waits at
    most the idle timeout for each next request; per source address and in all, at most the
    configured connections, an idle one's slot going to a newcomer when needed;
  - `wireup.HELLO_S`: the hello must arrive within this (and within the setup deadline);
  - SEND_S: a pull's response and payloads must be taken within it, else the endpoint is
    aborted and the pull's hold on the store released.
Per connection the server holds one request frame (<= MAX_REQUEST_BYTES) and one pull's payloads
(stored tensors, or copies charged to the store's pull budget). A bad peer ends its own
connection, with the reason logged, never the server.

CUDA tensors (raw codec): the server hands UCX the stored tensor's own device memory when the
client asked for device payloads and UCX here can send them (`runtime.honour_device`), else
pinned host copies.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import structlog

from droidmesh.shared.errors import BadMessageError, DroidMeshError
from droidmesh.shared.transport.bulk import MAX_REQUEST_BYTES, Authorize, Pin, Served, TensorLookup, answer, as_is
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits
from droidmesh.shared.transport.ucx import ops, runtime, wireup
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import PullRequest, Transport

log = structlog.get_logger("ucx")
SEND_S = 120.0


class UcxBulkServer:
    """Serves `PullRequest`s from a tensor lookup (the sender's store) over UCX endpoints wired up
    through a TCP socket bound to the configured host."""

    transport: Transport = "ucx"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, host: str, port: int = 0,
                 pin: Pin | None = None, limits: SlotLimits | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self._host, self._port = host, port
        self._listener = ControlListener("ucx", self._serve_connection, limits)
        self.slots = self._listener.slots

    place = staticmethod(as_is)

    async def start(self) -> str:
        """Listen on the configured host only (`ControlListener`); return "host:port"."""
        runtime.bind_devices(self._host)
        runtime.local_view()  # fails here, not per peer, where our own address cannot be read
        address, bound = await self._listener.start(self._host, self._port)
        log.info("ucx_server_started", bound=bound[0], port=bound[1], net_devices=runtime.net_devices())
        return address

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        ep: Any = None
        peer = writer.get_extra_info("peername")
        try:
            try:
                async with slot.waiting(), asyncio.timeout(wireup.HELLO_S):
                    hello = await wireup.read_hello(reader, writer)
                tag = secrets.randbits(64)
                writer.write(wireup.hello(tag))
                async with asyncio.timeout(wireup.HELLO_S):
                    await writer.drain()
                ep = await wireup.endpoint_to(hello, tag, writer)
            except SlotEnded:
                raise
            except BadMessageError as e:
                log.warning("ucx_connection_dropped", peer=str(peer), reason=str(e))
                return
            except TimeoutError:
                log.warning("ucx_connection_dropped", peer=str(peer), reason=f"no hello within {wireup.HELLO_S}s")
                return
            except Exception as e:  # the peer went away mid-hello, or UCX refused its address
                log.info("ucx_connection_dropped", peer=str(peer), reason=f"{type(e).__name__}: {e}"[:300])
                return
            ep._droidmesh_watch = asyncio.ensure_future(wireup.watch(reader, ep))
            await self._serve_endpoint(ep, slot)
        finally:
            ops.abort(ep)  # closes the TCP connection too, which ends the watch

    async def _serve_endpoint(self, ep: Any, slot: Slot) -> None:
        """Requests until the peer goes, breaks the protocol, or its slot ends (`SlotEnded`)."""
        try:
            while True:
                try:
                    async with slot.waiting():
                        await ops.wait_for_message(ep)
                        data = await ops.recv_frame(ep, MAX_REQUEST_BYTES)
                except SlotEnded:
                    raise
                except BadMessageError as e:
                    log.warning("ucx_connection_dropped", reason=str(e))
                    return
                except Exception:  # peer closed or died: this endpoint's loop ends, others go on
                    return
                if not await self._serve_request(ep, data, slot):
                    return
        finally:
            ops.abort(ep)

    async def _serve_request(self, ep: Any, data: bytes, slot: Slot) -> bool:
        """Answer one request (a pull sent in full proves the connection: `slot.pulled`); False
        when the connection must end (a send failed or timed out: the endpoint is aborted before
        the pull's payloads are let go)."""
        try:
            request = schemas.decode(data, PullRequest)
        except DroidMeshError as e:
            served = Served(schemas.PullResponse(headers=[], error=f"{e.code}: {str(e)[:500]}"), [], lambda: None)
        else:
            served = answer(runtime.honour_device(request), self._lookup, self._authorize, self._pin)
        response, payloads, release = served
        try:
            async with asyncio.timeout(SEND_S):
                await ops.send_obj(ep, schemas.encode(response))
                await asyncio.gather(*(ops.send(ep, ops.ucx_buffer(p)) for p in payloads))
            if not response.error:
                slot.pulled()
            return True
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.warning("ucx_send_failed", error=f"{type(e).__name__}: {e}", send_s=SEND_S)
            ops.abort(ep)  # UCX cancels the sends; each keeps its payload referenced until it reports back
            if isinstance(e, asyncio.CancelledError):
                raise
            return False
        finally:
            release()

    async def close(self) -> None:
        await self._listener.close()
