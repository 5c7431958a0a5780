"""The receiver's reuse pipeline: pull a holder's tensors while the engine already computes.

`reuse_generate` starts one UCX pull (transition-layer E first, then the reused KV layers in
layer order) and, concurrently, the engine in the torch worker thread. The engine blocks per
layer on an `ArrivingSource` the pull fills, so recompute begins the moment E lands. A pull
failure is reported into the source, which ends the engine's wait with `MissingLayerError`;
an engine failure cancels the pull. Either way the caller gets a `ReuseError` and falls back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from shared.errors import CacheLayoutError
from shared.kv.partial import Generation, generate
from shared.kv.plan import ReusePlan
from shared.kv.sources import ArrivingSource
from shared.model.fingerprint import ArchFingerprint, require_compatible
from shared.transport.tensors import DTYPES
from shared.wire import schemas
from shared.wire.schemas import PullItem, PullRequest

if TYPE_CHECKING:
    from services.receiver.service import ReceiverState


@dataclasses.dataclass
class ReuseOutcome:
    generation: Generation
    bytes_pulled: int
    stamps: dict[str, float]  # absolute time.perf_counter() per stage


def pull_items(plan: ReusePlan, num_layers: int) -> list[PullItem]:
    """E of each group's first layer first (recompute waits on it), then reused K/V by layer."""
    reused = range(num_layers) if plan.mode == "cacheblend" else plan.reused_layers(num_layers)
    return [PullItem(layer=l, kind="E") for l in plan.e_layers] + [
        PullItem(layer=l, kind=k) for l in reused for k in ("K", "V")
    ]


async def reuse_generate(
    s: ReceiverState, holder: schemas.CacheAvailable, plan: ReusePlan, prompt: list[int], max_new_tokens: int,
    timeout_s: float,
) -> ReuseOutcome:
    model = s.model
    fingerprint = ArchFingerprint.from_dict(msgspec.structs.asdict(holder.fingerprint))
    require_compatible(fingerprint, model.fingerprint)
    dtype = DTYPES.get(holder.dtype)
    if dtype != model.dtype:
        raise CacheLayoutError(f"sender cache dtype {holder.dtype}, receiver runs {model.dtype}")
    source = ArrivingSource(tuple(holder.token_ids), fingerprint)
    tokens = len(holder.token_ids)

    def expected(item: PullItem) -> tuple[list[int], torch.dtype]:
        shape = model.e_shape(tokens) if item.kind == "E" else model.kv_shape(tokens)
        return list(shape), model.dtype

    def on_tensor(item: PullItem, t: torch.Tensor) -> None:
        source.put(item.kind, item.layer, t)

    stamps: dict[str, float] = {}
    request = PullRequest(context_id=holder.context_id, items=pull_items(plan, model.num_layers),
                          token=holder.pull_token)

    async def pull() -> int:
        async with s.pull_slots:
            stamps["pull_start"] = time.perf_counter()
            try:
                return await s.bulk.pull(holder.ucx_host, holder.ucx_port, request, expected, on_tensor, timeout_s)
            except BaseException as e:
                source.fail(e)
                raise
            finally:
                stamps["pull_done"] = time.perf_counter()

    def run_engine() -> Generation:
        stamps["engine_start"] = time.perf_counter()
        return generate(model, prompt, plan, source, max_new_tokens=max_new_tokens,
                        eos_token_id=s.eos_token_id, timeout_s=timeout_s)

    pull_task = asyncio.get_running_loop().create_task(pull())
    try:
        gen = await s.run_torch(run_engine)
    except BaseException:
        pull_task.cancel()
        await asyncio.gather(pull_task, return_exceptions=True)
        raise
    pulled = await pull_task  # done: the engine consumed every layer it asked for
    for key, at in source.arrived_at.items():
        stamps[f"arrived_{key}"] = at
    for stage, rel in gen.prefill.stages.items():
        stamps[stage] = stamps["engine_start"] + rel
    stamps["first_token"] = stamps["engine_start"] + gen.ttft_s
    return ReuseOutcome(gen, pulled, stamps)
