"""The bulk channel: per-layer tensors peer to peer, never through the bus.

Two narrow roles, each a coroutine API on the owning service's event loop (none blocks the loop):
  `BulkServer` (sender)    `start()` listens and returns the address receivers dial (announced
                           in `CacheAvailable` with the channel's `transport` name); `close()`;
                           `place(tensors)` (blocking, the sender's torch thread, once per
                           context before it is stored) returns them where the channel serves
                           them from: `shm` moves them into sealed shared memory, the others
                           return them as they are.
  `BulkClient` (receiver)  `pull(address, request, into, on_item, timeout_s)` pulls the request's
                           items, in order, into the caller's buffers `into` (their shape, dtype and
                           device say what the receiver expects) and calls `on_item(item, tensor)`
                           on the loop as each one lands; `warm(address)`; `close()`.
Implementations: `ucx` (`shared/transport/ucx/`), `nixl` (`nixl/`) and `shm` (`shm/`, one host)
between real processes, and `inproc` (`inproc.py`, one process, no sockets: tests drive the
receiver with it). The networked clients share one skeleton (`client.py`).
`make_server` / `make_client` (`registry.py`, re-exported here) pick one by name and import only
that channel's module.

Every channel runs the same protocol, so its checks live here, once:
  1. the client sends one `PullRequest` (items in the order it wants them: E first);
  2. the server authorizes it (a single-use grant, `tokens.py`), looks every item up in its store, encodes each
     with the requested codec (or `raw` when it lacks that codec) and answers one `PullResponse`
     with every item's `TensorHeader` up front, then sends the payloads in order;
  3. the client checks every header against its own buffer (context, layer, kind, shape, dtype),
     that the codec is registered here and that the payload is no larger than that codec's
     bound for the buffer, all before receiving a byte; then, per landed payload, verifies the
     checksum and decodes into the buffer.

Peers are not trusted, so neither side allocates from what the other declares:
  - server: a request frame is at most `MAX_REQUEST_BYTES` (checked on the declared length,
    before a buffer exists); `check_request` bounds every count and string before anything is
    looked up; the token is checked before the store is touched; `tokens` (how many leading
    tokens the receiver wants) must fit the stored tensors, which are sliced to it
    ([.., :tokens, ..]: token axis 1 of E, 2 of K / V) so only what the receiver uses travels.
    The payloads a pull pins are held against the store (`Pin`): tensors evicted while a pull
    still sends them keep counting against its byte budget, and copies an encoding makes
    (a slice of K / V, pinned staging of CUDA tensors) against its pull budget, until the
    channel releases the hold (sent, failed, or timed out: every send has a deadline);
  - client: buffers are the caller's, sized from its own prompt and model (`pull.py`); a
    header must match them exactly, and staging is allocated only within the codec's bound
    for that buffer (`landings`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import structlog
import torch

from droidmesh.shared.errors import BadMessageError, DroidMeshError, IntegrityError, TransferError
from droidmesh.shared.kv import streams
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.transport import codecs, integrity, placement
from droidmesh.shared.transport.limits import (  # the limits every request meets, re-exported: callers import them here
    MAX_CODEC_PARAMS as MAX_CODEC_PARAMS,
)
from droidmesh.shared.transport.limits import MAX_ITEMS as MAX_ITEMS
from droidmesh.shared.transport.limits import MAX_LAYERS as MAX_LAYERS
from droidmesh.shared.transport.limits import MAX_REQUEST_BYTES as MAX_REQUEST_BYTES
from droidmesh.shared.transport.limits import MAX_STR as MAX_STR
from droidmesh.shared.transport.limits import MAX_TOKENS as MAX_TOKENS
from droidmesh.shared.transport.registry import TRANSPORTS as TRANSPORTS  # the factories live there; callers import them here
from droidmesh.shared.transport.registry import make_client as make_client
from droidmesh.shared.transport.registry import make_server as make_server
from droidmesh.shared.wire.schemas import LOWRANK_CODEC, PullItem, PullRequest, PullResponse, TensorHeader, Transport

log = structlog.get_logger("bulk")

# (context_id, layer, kind) -> the stored tensor, or None when the sender does not hold it.
TensorLookup = Callable[[str, int, str], "torch.Tensor | None"]
# Raises (e.g. `UnauthorizedError`) to refuse a pull; returns the grantee (the NATS user the grant
# went to, "" or None where unknown), whose connections the server's slots cap.
Authorize = Callable[[PullRequest], "str | None"]
# Called on the client's event loop as each item lands, in request order.
OnItem = Callable[[PullItem, torch.Tensor], None]


class PullHold(Protocol):
    """One pull's hold on a context's stored tensors (the sender's store implements it)."""

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` of per-pull copies; raise `TransferError` past the pull budget."""

    def refund(self, nbytes: int) -> None: ...

    def release(self) -> None:
        """The pull is over (idempotent): its copies and pinned tensors stop counting."""


# context_id -> a hold for one pull, taken only after the pull is authorized.
Pin = Callable[[str], PullHold]

class BulkServer(Protocol):
    transport: Transport

    async def start(self) -> str: ...

    def place(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    async def close(self) -> None: ...


class BulkClient(Protocol):
    transport: Transport

    async def pull(self, address: str, request: PullRequest, into: Sequence[torch.Tensor], on_item: OnItem,
                   timeout_s: float) -> int: ...

    async def warm(self, address: str) -> None: ...

    async def close(self) -> None: ...


def as_is(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`BulkServer.place` of a channel that serves tensors from wherever they are."""
    return list(tensors)


# -- server side ------------------------------------------------------------------------------
def check_request(request: PullRequest) -> None:
    """Raise `BadMessageError` for a request no well-behaved receiver sends: too many or repeated
    items, a layer or token count out of range, oversize strings or codec params."""
    if len(request.items) > MAX_ITEMS:
        raise BadMessageError(f"{len(request.items)} items; at most {MAX_ITEMS}")
    if len({(it.layer, it.kind) for it in request.items}) != len(request.items):
        raise BadMessageError("repeated items")
    if any(not 0 <= it.layer < MAX_LAYERS for it in request.items):
        raise BadMessageError(f"a layer outside [0, {MAX_LAYERS})")
    if not 0 <= request.tokens <= MAX_TOKENS:
        raise BadMessageError(f"tokens {request.tokens} outside [0, {MAX_TOKENS}]")
    if any(not 0 <= it.start <= MAX_TOKENS or (it.start and it.kind == "E") for it in request.items):
        raise BadMessageError(f"an item's start outside [0, {MAX_TOKENS}], or an E item not from token 0")
    if request.codec == LOWRANK_CODEC and any(it.start for it in request.items):
        # its K codes are made before RoPE at positions 0..T-1: a later start would rotate by the wrong ones
        raise BadMessageError(f"codec {LOWRANK_CODEC} codes whole token prefixes: an item starts at a later token")
    params = request.codec_params
    strings = [request.context_id, request.token, request.codec, *params, *(v for v in params.values() if isinstance(v, str))]
    if len(params) > MAX_CODEC_PARAMS or any(len(x) > MAX_STR for x in strings):
        raise BadMessageError(f"oversize request strings or codec params (at most {MAX_STR} chars, {MAX_CODEC_PARAMS} params)")


class Served(NamedTuple):
    """What a server sends for one request, and the hold it releases once the sends are over
    (completed, failed or timed out)."""

    response: PullResponse
    payloads: list[torch.Tensor]
    release: Callable[[], None]
    grantee: str = ""  # whose grant the pull used ("" where unknown, or refused)


class _NoHold:
    def charge(self, nbytes: int) -> None: ...

    def refund(self, nbytes: int) -> None: ...

    def release(self) -> None: ...


class Admitted(NamedTuple):
    """An authorized request's items: each one's stored tensor, the same cut to the tokens asked
    for (a view), and the pull's hold on the store (released by the caller)."""

    stored: list[torch.Tensor]
    views: list[torch.Tensor]
    hold: PullHold
    grantee: str = ""


def admit(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None, pin: Pin | None = None) -> Admitted:
    """Check, authorize and look up `request`, in that order, then take the hold; raises a
    `DroidMeshError` (bad message, unauthorized, unknown item, more tokens than stored) to refuse.
    Every channel's server starts a pull here."""
    check_request(request)
    grantee = (authorize(request) or "") if authorize is not None else ""
    stored, views = [], []
    for item in request.items:
        t = lookup(request.context_id, item.layer, item.kind)
        if t is None:
            raise TransferError(f"sender does not hold {request.context_id} layer {item.layer} {item.kind}")
        stored.append(t)
        views.append(_tokens(t, item, request.tokens))
    return Admitted(stored, views, pin(request.context_id) if pin is not None else _NoHold(), grantee)


def answer(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None, pin: Pin | None = None,
           checksums: bool = True) -> Served:
    """The response to `request` and the payloads to send after it, in item order. A refusal
    (malformed, unauthorized, unknown item, more tokens than stored, over the pull budget) is a
    response with `error` and no payloads. Order: `admit`, then encode. `checksums=False`: headers
    carry none (a channel that copies the sender's own memory, with no stream to corrupt)."""
    hold: PullHold = _NoHold()
    try:
        stored, tensors, hold, grantee = admit(request, lookup, authorize, pin)
        codec = _server_codec(request.codec)
        headers, payloads = [], []
        for item, t, whole in zip(request.items, tensors, stored, strict=True):
            # a codec's layout may depend on the item's kind and layer
            asked = {**request.codec_params, codecs.KIND_PARAM: item.kind, codecs.LAYER_PARAM: item.layer}
            bound = codec.max_nbytes(tuple(t.shape), t.dtype, asked)
            hold.charge(bound)  # before encoding: a copy is counted before it exists
            payload, params = codec.encode(t, asked)
            if _shares_memory(payload, t):
                hold.refund(bound)  # the stored tensor's own bytes: pinned, not copied
            headers.append(TensorHeader(context_id=request.context_id, layer=item.layer, kind=item.kind,
                                        shape=list(t.shape), dtype=dtype_name(t.dtype), codec=codec.name,
                                        codec_params=params, nbytes=payload.numel(),
                                        checksum=_payload_checksum(t, payload, cache=t is whole) if checksums else ""))
            payloads.append(payload)
    except DroidMeshError as e:
        hold.release()
        return Served(refusal(e), [], _NoHold().release)
    except BaseException:
        hold.release()
        raise
    return Served(PullResponse(headers=headers), payloads, hold.release, grantee)


def refusal(e: DroidMeshError) -> PullResponse:
    """The response refusing a pull for `e` (logged once, here)."""
    log.warning("pull_refused", code=e.code, error=str(e)[:200])
    return PullResponse(headers=[], error=f"{e.code}: {str(e)[:500]}")


def token_axis(kind: str) -> int:
    """The token axis of a stored item: E [1, T, D] -> 1, K / V [1, kvh, T, hd] -> 2."""
    return 1 if kind == "E" else 2


def _tokens(t: torch.Tensor, item: PullItem, tokens: int) -> torch.Tensor:
    """`t` cut to tokens [item.start, tokens) (`tokens` 0: all of them): a view, never a copy."""
    if tokens == 0 and item.start == 0:
        return t
    axis = token_axis(item.kind)
    if t.dim() <= axis:
        raise TransferError(f"stored layer {item.layer} {item.kind} has no token axis")
    end = tokens or t.shape[axis]
    if end > t.shape[axis]:
        raise TransferError(f"asks {end} tokens of layer {item.layer} {item.kind}, the context has {t.shape[axis]}")
    if item.start >= end:
        raise TransferError(f"layer {item.layer} {item.kind} from token {item.start}: the pull has {end} tokens")
    return t if (item.start, end) == (0, t.shape[axis]) else t.narrow(axis, item.start, end - item.start)


def _shares_memory(payload: torch.Tensor, t: torch.Tensor) -> bool:
    return payload.device == t.device and payload.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


# A stored tensor is never written after capture, so the checksum of its own bytes (the raw
# payload) is computed on its first pull only: id(tensor) -> checksum, dropped with the tensor.
_STORED_SUMS: dict[int, str] = {}


def _payload_checksum(t: torch.Tensor, payload: torch.Tensor, cache: bool) -> str:
    """`cache`: `t` is the stored tensor itself (a per-pull slice is a new object every time)."""
    if not cache or payload.data_ptr() != t.data_ptr() or payload.numel() != t.numel() * t.element_size():
        return integrity.checksum(payload)  # encoded afresh for this pull
    key = id(t)
    known = _STORED_SUMS.get(key)
    if known is None:
        known = _STORED_SUMS[key] = integrity.checksum(payload)
        weakref.finalize(t, _STORED_SUMS.pop, key, None)
    return known


def _server_codec(name: str) -> codecs.Codec:
    try:
        return codecs.get(name)
    except IntegrityError:  # a codec this sender lacks: raw is always understood
        return codecs.get("raw")


# -- client side ------------------------------------------------------------------------------
@dataclasses.dataclass
class Landing:
    """Where one item's payload is received (`placement.receive_place`): straight into the caller's
    buffer, or into a staging buffer that is decoded into it."""

    item: PullItem
    header: TensorHeader
    codec: codecs.Codec
    out: torch.Tensor  # the caller's buffer
    place: placement.Place
    staged: torch.Tensor | None = None  # the receive buffer once made (given here, or made at first use of `recv`)

    @property
    def recv(self) -> torch.Tensor:
        """uint8 [header.nbytes]: `out`'s own bytes or a staging buffer (host, pinned or device),
        made at first use (a channel that copies by address into `out` never needs the view)."""
        if self.staged is None:
            self.staged = placement.buffer_at(self.place, self.header, self.out)
        return self.staged

    @property
    def in_place(self) -> bool:
        """The payload is received as `out`'s own bytes (raw, contiguous, the size `out` is)."""
        return self.place == "out"

    def land(self, verify: bool = True) -> torch.Tensor:
        """Verify the received payload (unless the channel has nothing to verify: no wire) and
        decode it into `out`, both on the copy stream for a CUDA `out` (`streams.landing`: this
        thread waits for them, the compute stream does not); return `out`, ready to use. A raw
        payload received in place with nothing to verify is `out` already (a channel's own device
        copy into it waited for itself)."""
        if self.in_place and not verify:
            return self.out
        with streams.landing(self.out.device):
            if verify:
                got = integrity.checksum(self.recv)
                if got != self.header.checksum:
                    raise IntegrityError(f"checksum mismatch for layer {self.item.layer} {self.item.kind}: "
                                         f"{got} != {self.header.checksum}")
            self.codec.decode(self.recv, self.header, self.out)
        return self.out


def landings(request: PullRequest, response: PullResponse, into: Sequence[torch.Tensor]) -> list[Landing]:
    """Check the response against the request and the caller's buffers; allocate only what a
    checked header allows. Raises `TransferError` (refused) or `IntegrityError` (mismatch)."""
    if response.error:
        raise TransferError(f"sender refused the pull: {response.error}")
    if len(into) != len(request.items):
        raise ValueError(f"{len(into)} buffers for {len(request.items)} items")
    if len(response.headers) != len(request.items):
        raise IntegrityError(f"{len(response.headers)} headers for {len(request.items)} items")
    out = []
    for item, header, buf in zip(request.items, response.headers, into, strict=True):
        want = (request.context_id, item.layer, item.kind, list(buf.shape), dtype_name(buf.dtype))
        got = (header.context_id, header.layer, header.kind, list(header.shape), header.dtype)
        if got != want:
            raise IntegrityError(f"header {got} does not match the expected layout {want}")
        codec = codecs.get(header.codec)
        bound = codec.max_nbytes(tuple(buf.shape), buf.dtype, header.codec_params)
        if not 0 <= header.nbytes <= bound:
            raise IntegrityError(f"layer {item.layer} {item.kind}: {header.nbytes} encoded bytes, "
                                 f"{header.codec} allows at most {bound}")
        if codecs.asks_device(header.codec_params) and not (codecs.asks_device(request.codec_params)
                                                            or request.device_exports):
            raise IntegrityError(f"layer {item.layer} {item.kind}: a device payload this receiver did not ask for")
        out.append(Landing(item, header, codec, buf, placement.receive_place(codec, header, buf)))
    return out
