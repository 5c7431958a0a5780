"""The in-process bulk channel: a sender and a receiver in one process, no sockets.

Tests drive the receiver's whole reuse path with it (pull, header checks, codecs, per-item
delivery while the engine computes) without UCX. Servers register under a name in a process-wide
table; the address a client dials is that name. Payloads are copied into the client's receive
buffers one item at a time, yielding to the loop between items, so items land one by one as
they would from a network; the protocol's checks are the same as UCX's (`bulk.py`, `answer.py`).

`CodedSource` is the same protocol with no channel and no loop: a captured context as a receiver
holds it after pulling it under a codec (the profiler and `eval` score compressed transfer with it,
and tests compare the mesh's answers against it).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import msgspec
import torch

from droidmesh.shared.errors import MissingLayerError, TransferError
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.transport.answer import answer
from droidmesh.shared.transport.bulk import Authorize, OnItem, Pin, TensorLookup, as_is, landings
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import CodecParams, ItemKind, PullItem, PullRequest, Transport

_SERVERS: dict[str, InProcessBulkServer] = {}
_names = itertools.count()


class InProcessBulkServer:
    transport: Transport = "inproc"

    def __init__(self, lookup: TensorLookup, authorize: Authorize | None, *, name: str = "", pin: Pin | None = None):
        self._lookup, self._authorize, self._pin = lookup, authorize, pin
        self.name = name or f"inproc-{next(_names)}"

    place = staticmethod(as_is)

    async def start(self) -> str:
        if self.name in _SERVERS:
            raise TransferError(f"an in-process bulk server named {self.name!r} already runs")
        _SERVERS[self.name] = self
        return self.name

    def serve(self, request_bytes: bytes) -> tuple[bytes, list[torch.Tensor], Callable[[], None]]:
        """The encoded response, the payloads (exactly as a network server would send them) and
        the hold's release, called once the client has copied them."""
        request = schemas.decode(request_bytes, PullRequest)
        response, payloads, release, _ = answer(request, self._lookup, self._authorize, self._pin)
        return schemas.encode(response), payloads, release

    async def close(self) -> None:
        _SERVERS.pop(self.name, None)


class InProcessBulkClient:
    transport: Transport = "inproc"

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int:
        """Pull from the server registered as `address`; same contract as `UcxBulkClient.pull`."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._pull(address, request, into, on_item)
        except TimeoutError:
            raise TransferError(f"pull from {address} exceeded {timeout_s:.3g}s") from None

    async def _pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor],
                    on_item: OnItem) -> int:
        server = _SERVERS.get(address)
        if server is None:
            raise TransferError(f"no in-process bulk server at {address!r}")
        response_bytes, payloads, release = server.serve(schemas.encode(request))
        try:
            lands = landings(request, schemas.decode(response_bytes, schemas.PullResponse), into)
            for land, payload in zip(lands, payloads, strict=True):
                await asyncio.sleep(0)  # one item at a time, as from a network
                if payload.numel() != land.recv.numel():
                    raise TransferError(f"layer {land.item.layer} {land.item.kind}: sent {payload.numel()} bytes, "
                                        f"header said {land.recv.numel()}")
                _copy(land.recv, payload)
                on_item(land.item, land.land())
        finally:
            release()
        return sum(land.header.nbytes for land in lands)

    async def warm(self, address: str) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to release."""


class CodedSource:
    """A `LayerSource` over `captured`'s first `tokens` tokens (None: all) as they land after a pull
    under `codec`: each read runs the bulk protocol's `answer` and `landings` (encode, header
    checks, checksum, decode into a fresh buffer on the captured tensors' device) on the calling
    thread, once per item. Protocol errors raise as they would from a pull."""

    def __init__(self, captured: CapturedContext, codec: str, codec_params: CodecParams | None = None,
                 tokens: int | None = None):
        self._captured = captured
        self.token_ids = captured.token_ids[:tokens]
        self.fingerprint = captured.fingerprint
        self._request = PullRequest(context_id="inproc", items=[], codec=codec, codec_params=dict(codec_params or {}),
                                    tokens=len(self.token_ids))
        self._kv: dict[int, KVBlock] = {}
        self._e: dict[int, torch.Tensor] = {}

    def kv(self, layer: int, deadline: float) -> KVBlock:
        if layer not in self._kv:
            if not 0 <= layer < self._captured.num_layers:
                raise MissingLayerError(f"sender has no KV for layer {layer}")
            self._kv[layer] = KVBlock(layer, self._pull(layer, "K"), self._pull(layer, "V"))
        return self._kv[layer]

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        if layer not in self._e:
            if layer not in self._captured.e:
                raise MissingLayerError(f"sender captured no E for layer {layer} (has {sorted(self._captured.e)})")
            self._e[layer] = self._pull(layer, "E")
        return self._e[layer]

    def _lookup(self, context_id: str, layer: int, kind: str) -> torch.Tensor | None:
        if kind == "E":
            return self._captured.e.get(layer)
        block = self._captured.kv[layer]
        return block.k if kind == "K" else block.v

    def _pull(self, layer: int, kind: ItemKind) -> torch.Tensor:
        request = msgspec.structs.replace(self._request, items=[PullItem(layer=layer, kind=kind)])
        response, payloads, release, _ = answer(request, self._lookup, None, None)
        try:
            stored = self._lookup("", layer, kind)
            assert stored is not None  # looked up by `answer` already, which refuses a missing item
            shape = list(stored.shape)
            shape[1 if kind == "E" else 2] = len(self.token_ids)  # E [1, T, D], K / V [1, kvh, T, hd]
            out = torch.empty(shape, dtype=stored.dtype, device=stored.device)
            (land,) = landings(request, response, [out])
            _copy(land.recv, payloads[0])
            return land.land()
        finally:
            release()


def _copy(recv: torch.Tensor, payload: torch.Tensor) -> None:
    """A payload into its landing buffer, as a wire would leave it: done before `land` decodes it
    (on CUDA the copy runs on this thread's stream, and the landing's copy stream does not wait
    for that stream)."""
    recv.copy_(payload)
    if recv.is_cuda or payload.is_cuda:
        torch.cuda.current_stream(recv.device if recv.is_cuda else payload.device).synchronize()
