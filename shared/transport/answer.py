"""The sender's side of the bulk protocol (`bulk.py` says what every channel runs): a request
checked, authorized and looked up (`admit`), charged against the pull budget for the copies its
encoding will make, then encoded into the response and payloads a channel sends (`answer`;
`answer_async` on a server's event loop, the encoding on a worker thread).

Peers are not trusted, so nothing here allocates from what a receiver declares: a request frame
is at most `MAX_REQUEST_BYTES` (checked by the channel on the declared length, before a buffer
exists); `check_request` bounds every count and string before anything is looked up; the token
is checked before the store is touched; `tokens` (how many leading tokens the receiver wants)
must fit the stored tensors, which are sliced to it ([.., :tokens, ..]: token axis 1 of E, 2 of
K / V) so only what the receiver uses travels. The payloads a pull pins are held against the
store (`Pin`): tensors evicted while a pull still sends them keep counting against its byte
budget, and copies an encoding makes (a slice of K / V, an encoding, pinned staging of CUDA
tensors) against its pull budget, until the channel releases the hold (sent, failed, or timed
out: every send has a deadline).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import structlog
import torch

from droidmesh.shared.errors import BadMessageError, DroidMeshError, IntegrityError, TransferError
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.transport import codecs, integrity, workers
from droidmesh.shared.transport.bulk import Authorize, Pin, PullHold, TensorLookup, token_axis
from droidmesh.shared.transport.limits import MAX_CODEC_PARAMS, MAX_ITEMS, MAX_LAYERS, MAX_STR, MAX_TOKENS
from droidmesh.shared.wire.schemas import LOWRANK_CODEC, CodecParams, PullItem, PullRequest, PullResponse, TensorHeader

log = structlog.get_logger("bulk")


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


class _Job(NamedTuple):
    """One admitted item to encode: the tokens asked for (`view`) of its stored tensor (`whole`),
    the params its codec gets, and the bytes its encoding is charged (0: it sends `view`'s own bytes)."""

    item: PullItem
    view: torch.Tensor
    whole: torch.Tensor
    asked: CodecParams
    charged: int


class _Begun(NamedTuple):
    codec: codecs.Codec
    jobs: list[_Job]
    hold: PullHold
    grantee: str


def answer(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None, pin: Pin | None = None,
           checksums: bool = True) -> Served:
    """The response to `request` and the payloads to send after it, in item order. A refusal
    (malformed, unauthorized, unknown item, more tokens than stored, over the pull budget) is a
    response with `error` and no payloads. Order: `admit`, charge the pull for the copies its
    encoding makes (`_begin`), encode. `checksums=False`: headers carry none (a channel that copies
    the sender's own memory, with no stream to corrupt). Encodes on the calling thread: a server on
    an event loop uses `answer_async`."""
    try:
        begun = _begin(request, lookup, authorize, pin)
    except DroidMeshError as e:
        return Served(refusal(e), [], _NoHold().release)
    try:
        return _served(begun, _encode(request.context_id, begun, checksums))
    except DroidMeshError as e:
        return _refused(begun.hold, e)
    except BaseException:
        begun.hold.release()
        raise


async def answer_async(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None,
                       pin: Pin | None = None, checksums: bool = True) -> Served:
    """`answer` for a server on an event loop: admitting and charging stay on the loop (the store
    is the loop's), and whatever encoding costs time (quantizing, copying device memory to the
    host, a payload's checksum) runs on an encoding thread, so the sender keeps granting other
    pulls and beating its heartbeat meanwhile. A pull with nothing to do (its items' own bytes,
    their checksums known) is answered on the loop: a thread hop would cost more. Cancelled, the
    hold is released once the thread is done (`workers.run_settled`; an encoding not begun never
    runs)."""
    try:
        begun = _begin(request, lookup, authorize, pin)
    except DroidMeshError as e:
        return Served(refusal(e), [], _NoHold().release)
    try:
        if not _has_work(begun, checksums):
            return _served(begun, _encode(request.context_id, begun, checksums))
        return _served(begun, await workers.run_settled(workers.encoders(), _encode, request.context_id, begun,
                                                        checksums))
    except DroidMeshError as e:
        return _refused(begun.hold, e)
    except BaseException:  # a cancel included: the encoding is done or was never begun
        begun.hold.release()
        raise


def _refused(hold: PullHold, e: DroidMeshError) -> Served:
    """A pull refused after its hold was taken: released, the refusal answered."""
    hold.release()
    return Served(refusal(e), [], _NoHold().release)


def _begin(request: PullRequest, lookup: TensorLookup, authorize: Authorize | None, pin: Pin | None) -> _Begun:
    """`admit`, then charge the hold each item's encoding bound unless the codec sends the item's
    own bytes (`codecs.sends_own_bytes`): a copy is counted before it exists, and a plan's items
    sent as they lie are never refused for copies they do not make."""
    stored, views, hold, grantee = admit(request, lookup, authorize, pin)
    try:
        codec = _server_codec(request.codec)
        jobs = []
        for item, view, whole in zip(request.items, views, stored, strict=True):
            # a codec's layout may depend on the item's kind and layer
            asked = {**request.codec_params, codecs.KIND_PARAM: item.kind, codecs.LAYER_PARAM: item.layer}
            bound = 0 if codecs.sends_own_bytes(codec, asked, view) else codec.max_nbytes(tuple(view.shape), view.dtype, asked)
            hold.charge(bound)
            jobs.append(_Job(item, view, whole, asked, bound))
    except BaseException:
        hold.release()
        raise
    return _Begun(codec, jobs, hold, grantee)


def _has_work(begun: _Begun, checksums: bool) -> bool:
    """Whether encoding `begun` copies anything or hashes a payload whose checksum is not known."""
    return any(j.charged or (checksums and _known_sum(j.view, j.whole) is None) for j in begun.jobs)


class _Encoded(NamedTuple):
    headers: list[TensorHeader]
    payloads: list[torch.Tensor]
    refund: int  # charged bytes of encodings that turned out to be the stored tensor's own


def _encode(context_id: str, begun: _Begun, checksums: bool) -> _Encoded:
    """Every job's payload and header, in order (any thread: it touches neither the store nor the
    hold; the checksum cache it shares with the loop is a dict read and written one key at a time)."""
    headers, payloads, refund = [], [], 0
    for j in begun.jobs:
        payload, params = begun.codec.encode(j.view, j.asked)
        if j.charged and _shares_memory(payload, j.view):
            refund += j.charged  # the stored tensor's own bytes after all: pinned, not copied
        headers.append(TensorHeader(context_id=context_id, layer=j.item.layer, kind=j.item.kind,
                                    shape=list(j.view.shape), dtype=dtype_name(j.view.dtype), codec=begun.codec.name,
                                    codec_params=params, nbytes=payload.numel(),
                                    checksum=_payload_checksum(j.view, payload, j.whole) if checksums else ""))
        payloads.append(payload)
    return _Encoded(headers, payloads, refund)


def _served(begun: _Begun, encoded: _Encoded) -> Served:
    begun.hold.refund(encoded.refund)
    return Served(PullResponse(headers=encoded.headers), encoded.payloads, begun.hold.release, begun.grantee)


def refusal(e: DroidMeshError) -> PullResponse:
    """The response refusing a pull for `e` (logged once, here)."""
    log.warning("pull_refused", code=e.code, error=str(e)[:200])
    return PullResponse(headers=[], error=f"{e.code}: {str(e)[:500]}")


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


def _known_sum(t: torch.Tensor, whole: torch.Tensor) -> str | None:
    """The cached checksum of `t`'s own bytes, when `t` is the stored tensor `whole` itself (a
    token slice is a new object every pull: hashed afresh)."""
    return _STORED_SUMS.get(id(whole)) if t is whole else None


def _payload_checksum(t: torch.Tensor, payload: torch.Tensor, whole: torch.Tensor) -> str:
    """Of `payload`, `t`'s encoding; `t`'s own bytes are hashed once per stored tensor."""
    if t is not whole or payload.data_ptr() != t.data_ptr() or payload.numel() != t.numel() * t.element_size():
        return integrity.checksum(payload)  # encoded afresh for this pull
    known = _known_sum(t, whole)
    if known is None:
        known = _STORED_SUMS[id(t)] = integrity.checksum(payload)
        weakref.finalize(t, _STORED_SUMS.pop, id(t), None)
    return known


def _server_codec(name: str) -> codecs.Codec:
    try:
        return codecs.get(name)
    except IntegrityError:  # a codec this sender lacks: raw is always understood
        return codecs.get("raw")
