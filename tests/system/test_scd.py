"""SCD over the mesh: a pair config naming learned maps reaches running services, the receiver
pulls low-rank codes over UCX, and its answer equals the in-process engine under the same config."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from droidmesh.shared.kv import policy, scd
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.profiling import scd_fit
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.inproc import CodedSource
from droidmesh.shared.wire import schemas
from tests.system.conftest import until_indexed, words

pytestmark = pytest.mark.system

QUESTION = " what is gamma"
THREADS = {"OMP_NUM_THREADS": "1"}
PLAN = ReusePlan.recompute(2, 4)


def _fit(tiny_pair: tuple[Path, Path], tiny_models) -> tuple[scd.Maps, bytes]:
    """Maps fitted on a few filler contexts, every reused layer at 90% of the fitted variance."""
    sender, receiver = tiny_models
    contexts = [text.prompt_ids(receiver.tokenizer, words(200, offset=o), "")[0] for o in range(4)]
    meta = {"sender_sha256": weights_sha256(tiny_pair[0]), "receiver_sha256": weights_sha256(tiny_pair[1])}
    return scd_fit.maps_for(scd_fit.calibrate(sender, receiver, contexts, meta=meta, progress=False), PLAN, 0.9)


def _config(tiny_pair: tuple[Path, Path], sha: str, version: int) -> schemas.RecomputeConfig:
    spec = policy.spec_of(PLAN, "lowrank", {codecs.MAPS_PARAM: sha})
    point = schemas.FrontierPoint(spec, recomputed_layers=2, quality=0.99, wire_bytes_per_token=1)
    return schemas.RecomputeConfig(
        sender_model="sender", receiver_model="receiver", sender_sha256=weights_sha256(tiny_pair[0]),
        receiver_sha256=weights_sha256(tiny_pair[1]), profile_version=version, task="test", tolerance=0.05,
        chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6,
        created_at=time.time())


def _start(services, url: str, tiny_pair: tuple[Path, Path]) -> str:
    """A broker, the pair's sender and receiver, as processes on `url`; returns `url`."""
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender"}, url, env=THREADS))
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver"}, url, env=THREADS))
    return url


async def _ask_until(client: MeshClient, model, want: str, offset: int, tries: int = 40) -> tuple[str, schemas.GenerateReply]:
    """Prefill fresh contexts and ask over each until a reply's plan is `want` (configs and maps
    reach the services asynchronously); return that context and reply (or the last ones)."""
    for i in range(tries):
        context = words(300 + i, offset=offset)
        await client.prefill("sender", context)
        await until_indexed(client, model, context)
        reply = await client.ask("receiver", context, QUESTION, max_new_tokens=6)
        if reply.plan == want or reply.fallback_reason and "maps" in reply.fallback_reason:
            return context, reply
    return context, reply


def test_receiver_answers_with_scd_codes_equal_to_the_engine(nats, services, tiny_pair, tiny_models):
    """A published lowrank config: the reply names the plan and codec, pulls fewer bytes than the
    raw KV of the reused layers, and its tokens equal the in-process engine's with the same maps."""
    maps, data = _fit(tiny_pair, tiny_models)
    url = _start(services, nats[1], tiny_pair)

    async def run():
        client = await MeshClient.connect(url)
        try:
            sha = await client.bus.maps_store().put(data)
            await client.bus.config_board().put(_config(tiny_pair, sha, version=1))
            return sha, *await _ask_until(client, tiny_models[1], PLAN.label(), offset=3)
        finally:
            await client.close()

    sha, context, reply = asyncio.run(run())
    assert sha == maps.sha256
    assert (reply.path, reply.plan, reply.codec) == ("partial", "recompute [2,4)", "lowrank"), reply
    sender_m, receiver_m = tiny_models
    ctx, q = text.prompt_ids(receiver_m.tokenizer, context, QUESTION)
    one = math.prod(receiver_m.kv_shape(len(ctx))) * receiver_m.dtype.itemsize  # one layer's K, raw
    raw_reused = 2 * one * len(PLAN.reused_layers(receiver_m.num_layers))
    assert 0 < reply.bytes_pulled < raw_reused / 2, (reply.bytes_pulled, raw_reused)
    codecs.LOWRANK.add_maps(maps)
    source = CodedSource(capture_prefill(sender_m, ctx, PLAN.e_layers), "lowrank", {codecs.MAPS_PARAM: sha},
                         tokens=len(ctx))
    ref = generate(receiver_m, ctx + q, PLAN, source, max_new_tokens=6, eos_token_id=receiver_m.tokenizer.eos_token_id)
    assert reply.token_ids == ref.tokens


def test_a_config_whose_maps_are_missing_falls_back_and_says_why(nats, services, tiny_pair, tiny_models):
    """A config naming maps nobody published: the receiver answers by its own full prefill, the
    reply's reason naming the maps; nothing crashes."""
    url = _start(services, nats[1], tiny_pair)

    async def run():
        client = await MeshClient.connect(url)
        try:
            await client.bus.config_board().put(_config(tiny_pair, "ab" * 32, version=1))
            return await _ask_until(client, tiny_models[1], "never", offset=5, tries=20)
        finally:
            await client.close()

    _, reply = asyncio.run(run())
    assert reply.path == "fallback" and reply.plan == "full prefill", reply
    assert "maps_unavailable" in (reply.fallback_reason or "") and "abababababab" in reply.fallback_reason, reply
