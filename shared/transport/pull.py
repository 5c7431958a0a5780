"""The one pull helper: a holder's tensors for a reuse plan, into the engine's `ArrivingSource`.

Used by the receiver's reuse pipeline and by the pipelining benchmark, so both pull the same
items in the same order into the same buffers:
  1. `pull_items(plan)`: each group's transition E first (recompute waits on it), then the
     reused K/V layer by layer (the suffix needs them in that order);
  2. `pull_into(...)`: one buffer per item, allocated by the receiver from its own model's layout
     on its own device (never from what the peer declares), pulled over the bulk channel; each
     landed item is handed to the source, which wakes the engine waiting for that layer.
"""

from __future__ import annotations

import msgspec
import torch

from shared.device import dtype_name
from shared.errors import CacheLayoutError, TransferError
from shared.kv.plan import ReusePlan
from shared.kv.sources import ArrivingSource
from shared.model.adapter import ModelAdapter
from shared.model.fingerprint import ArchFingerprint
from shared.transport.bulk import BulkClient
from shared.wire.schemas import CacheAvailable, CodecParams, PullItem, PullRequest


def pull_items(plan: ReusePlan, num_layers: int) -> list[PullItem]:
    """E of each group's first layer first, then the reused K/V by layer."""
    reused = range(num_layers) if plan.mode == "cacheblend" else plan.reused_layers(num_layers)
    return [PullItem(layer=l, kind="E") for l in plan.e_layers] + [
        PullItem(layer=l, kind=k) for l in reused for k in ("K", "V")
    ]


def source_for(holder: CacheAvailable) -> ArrivingSource:
    """An empty source for `holder`'s context, filled as its items land."""
    fingerprint = ArchFingerprint.from_dict(msgspec.structs.asdict(holder.fingerprint))
    return ArrivingSource(tuple(holder.token_ids), fingerprint)


def buffers(model: ModelAdapter, tokens: int, items: list[PullItem]) -> list[torch.Tensor]:
    """The receiver's own buffer per item, on its device: E [1, T, D], K / V [1, kvh, T, hd]."""
    return [torch.empty(model.e_shape(tokens) if it.kind == "E" else model.kv_shape(tokens),
                        dtype=model.dtype, device=model.device) for it in items]


async def pull_into(bulk: BulkClient, holder: CacheAvailable, items: list[PullItem], model: ModelAdapter,
                    source: ArrivingSource | None, timeout_s: float, *, codec: str = "raw",
                    codec_params: CodecParams | None = None) -> int:
    """Pull `items` of `holder`'s context into fresh buffers, delivering each to `source` (None:
    transfer only) as it lands; return the payload bytes pulled. Raises `ReuseError`s."""
    if holder.transport != bulk.transport:
        raise TransferError(f"holder serves over {holder.transport}, this receiver pulls over {bulk.transport}")
    if holder.dtype != dtype_name(model.dtype):
        raise CacheLayoutError(f"sender cache dtype {holder.dtype}, receiver runs {dtype_name(model.dtype)}")
    request = PullRequest(context_id=holder.context_id, items=items, token=holder.pull_token, codec=codec,
                          codec_params=codec_params or {})

    def on_item(item: PullItem, t: torch.Tensor) -> None:
        if source is not None:
            source.put(item.kind, item.layer, t)

    return await bulk.pull(holder.address, request, buffers(model, len(holder.token_ids), items), on_item, timeout_s)
