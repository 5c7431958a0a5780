"""The one pull helper: a holder's tensors for a reuse plan, into the engine's `ArrivingSource`.

Used by the receiver's reuse pipeline and by the pipelining benchmark, so both pull the same
items in the same order into the same buffers:
  1. `pull_items(plan)`: each group's transition E first (recompute waits on it), then the
     reused K/V layer by layer (the suffix needs them in that order);
  2. `request_grant(...)`: a single-use grant for this pull from the holder's sender, over NATS
     (`shared/transport/tokens.py`); then `pull_into(...)`: one buffer per item, allocated by the receiver from its own model's layout
     on its own device for the m tokens it will reuse (never from what the peer declares), pulled
     over the bulk channel (`PullRequest.tokens = m`: the sender sends only that prefix); each
     landed item is handed to the source, which wakes the engine waiting for that layer. m is
     the reusable prefix of the receiver's own prompt (`source_for(holder, prompt)`), so a
     31-token match pulls 31 tokens, not the holder's whole context;
  3. concurrently, the engine's steps run on the torch thread (`shared/service/engine.py`
     `drive_engine`), waiting on the event loop for a layer that has not landed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import torch

from droidmesh.shared.errors import BadMessageError, CacheLayoutError, DroidMeshError, ReuseError, TransferError
from droidmesh.shared.kv import streams
from droidmesh.shared.kv.blocks import reusable_prefix
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.model.fingerprint import ArchFingerprint
from droidmesh.shared.transport.bulk import BulkClient
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.schemas import CacheAvailable, CodecParams, PullItem, PullRequest


class Layout(Protocol):
    """What the receiver allocates pull buffers by: the receiver's own model (`ModelAdapter`), or a
    `ForeignLayout` for another model's tensors (a translated pair's source E)."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    def e_shape(self, tokens: int) -> tuple[int, ...]: ...
    def kv_shape(self, tokens: int) -> tuple[int, ...]: ...


@dataclasses.dataclass(frozen=True)
class ForeignLayout:
    """Another model's tensor shapes (from its fingerprint, which we hold: never what a peer
    declares), landing in this receiver's dtype on its device."""

    fingerprint: ArchFingerprint
    dtype: torch.dtype
    device: torch.device

    def e_shape(self, tokens: int) -> tuple[int, ...]:
        return (1, tokens, self.fingerprint.hidden_size)

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        return (1, self.fingerprint.num_kv_heads, tokens, self.fingerprint.head_dim)


def pull_items(plan: ReusePlan, num_layers: int, starts: Mapping[int, int] | None = None) -> list[PullItem]:
    """E of each group's first layer first, then the reused K/V by layer, layer l's from token
    `starts[l]` (`ReusePlan.window_starts`: a sliding-window layer's keys a query can still read)."""
    reused = range(num_layers) if plan.mode == "cacheblend" else plan.reused_layers(num_layers)
    starts = starts or {}
    return [PullItem(layer=l, kind="E") for l in plan.e_layers] + [
        PullItem(layer=l, kind=k, start=starts.get(l, 0)) for l in reused for k in ("K", "V")
    ]


def window_starts(plan: ReusePlan, windows: Sequence[int | None], tokens: int, codec: str) -> dict[int, int]:
    """The plan's `window_starts` over a pull of `tokens` tokens, where the codec may send a later
    token range (a lowrank code is made from position 0: it pulls every token)."""
    return {} if codec == schemas.LOWRANK_CODEC else plan.window_starts(windows, tokens)


def source_for(holder: CacheAvailable, prompt: list[int] | None = None) -> ArrivingSource:
    """An empty source for `holder`'s context, filled as its items land: with `prompt`, only the
    context's reusable prefix for it (what the engine will use, and all `pull_into` pulls);
    without, the whole context (transfer benchmarks)."""
    fingerprint = ArchFingerprint.from_dict(msgspec.structs.asdict(holder.fingerprint))
    if prompt is None:
        return ArrivingSource(tuple(holder.token_ids), fingerprint)
    m = reusable_prefix(holder.token_ids, prompt)
    if m == 0:
        raise ReuseError("the sender's context shares no token prefix with the prompt")
    return ArrivingSource(tuple(holder.token_ids[:m]), fingerprint)


def buffers(model: Layout, tokens: int, items: list[PullItem]) -> list[torch.Tensor]:
    """The receiver's own buffer per item, on its device: E [1, T, D], K / V [1, kvh, T - start, hd]
    (on CUDA from the copy stream's pool, see `streams`)."""
    return [streams.empty(model.e_shape(tokens) if it.kind == "E" else model.kv_shape(tokens - it.start), model.dtype,
                          model.device) for it in items]


def widened(model: Layout, tokens: int, item: PullItem, t: torch.Tensor) -> torch.Tensor:
    """A K / V item pulled from token `item.start` as the engine reads a context's layer:
    [1, kvh, tokens, hd], zeros before the start (never read: no query's window reaches them)."""
    if item.start == 0:
        return t
    # Like a landing: from the copy stream's pool, on the copy stream, waited for by this (the
    # channel's) thread alone, so no compute queued meanwhile is waited on (`streams`).
    whole = streams.empty(model.kv_shape(tokens), t.dtype, t.device)  # [1, kvh, tokens, hd]
    with streams.landing(t.device):
        whole[:, :, :item.start].zero_()
        whole[:, :, item.start:] = t  # t [1, kvh, tokens - start, hd]
    return whole


Request = Callable[[str, bytes, float], Awaitable[bytes]]  # NATS request: subject, payload, timeout -> reply


def requester(nc: Any) -> Request:
    """A nats-py connection's `request` in the shape `request_grant` takes (tools and tests that
    hold a raw connection; services pass their bus's `request`)."""

    async def request(subject: str, data: bytes, timeout: float) -> bytes:
        return (await nc.request(subject, data, timeout=timeout)).data

    return request


class Granting(Protocol):
    """What a grant request names: the holder's sender and the context (a `CacheAvailable`)."""

    @property
    def sender_id(self) -> str: ...
    @property
    def context_id(self) -> str: ...


async def request_grant(request: Request, holder: Granting, timeout_s: float) -> str:
    """A single-use grant to pull `holder`'s context, from its sender (the reply reaches only the
    asking user's inbox). `TransferError` when the sender does not answer in time or refuses."""
    try:
        data = await request(subjects.sender_grant(holder.sender_id),
                             schemas.encode(schemas.GrantRequest(context_id=holder.context_id)), timeout_s)
    except TimeoutError:
        raise TransferError(f"sender {holder.sender_id} gave no pull grant within {timeout_s:.3g}s") from None
    try:
        return schemas.decode(data, schemas.GrantReply).token
    except DroidMeshError:
        pass
    try:
        err = schemas.decode(data, schemas.ErrorReply)
    except DroidMeshError as e:
        raise TransferError(f"sender {holder.sender_id} answered the grant request with garbage ({e})") from None
    raise TransferError(f"sender {holder.sender_id} refused a pull grant: {err.code}: {err.message[:200]}")


async def pull_into(bulk: BulkClient, holder: CacheAvailable, items: list[PullItem], model: Layout,
                    source: ArrivingSource | None, timeout_s: float, *, token: str, codec: str = "raw",
                    codec_params: CodecParams | None = None, tokens: int | None = None) -> int:
    """Pull the first `tokens` tokens (default: as many as `source` holds, else the whole
    context) of `items` of `holder`'s context into fresh buffers under the grant `token`,
    delivering each to `source` (None: transfer only) as it lands; return the payload bytes
    pulled. Raises `ReuseError`s."""
    if holder.transport != bulk.transport:
        raise TransferError(f"holder serves over {holder.transport}, this receiver pulls over {bulk.transport}")
    if holder.dtype != dtype_name(model.dtype):
        raise CacheLayoutError(f"sender cache dtype {holder.dtype}, receiver runs {dtype_name(model.dtype)}")
    if tokens is None:
        tokens = len(source.token_ids) if source is not None else len(holder.token_ids)
    if not 0 < tokens <= len(holder.token_ids) or (source is not None and tokens != len(source.token_ids)):
        raise TransferError(f"pull of {tokens} tokens: the context has {len(holder.token_ids)}"
                            + (f", the source expects {len(source.token_ids)}" if source is not None else ""))
    request = PullRequest(context_id=holder.context_id, items=items, token=token, codec=codec,
                          codec_params=codec_params or {}, tokens=tokens)

    if any(not 0 <= it.start < tokens or (it.start and it.kind == "E") for it in items):
        raise TransferError(f"a pulled item starts outside its K / V's {tokens} tokens")

    def on_item(item: PullItem, t: torch.Tensor) -> None:
        if source is not None:
            source.put(item.kind, item.layer, widened(model, tokens, item, t))

    try:
        return await bulk.pull(holder.address, request, buffers(model, tokens, items), on_item, timeout_s)
    except BadMessageError as e:
        # malformed bytes from the holder are the holder's fault, not the request's: the caller
        # falls back to its own prefill instead of refusing the client
        raise TransferError(f"sender {holder.sender_id} sent a malformed reply: {e}") from None
