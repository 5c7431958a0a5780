"""Recompute configs flow through the JetStream bucket into running services."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.wire import schemas
from tests.system.conftest import until_indexed, words

pytestmark = pytest.mark.system

CONTEXT = words(160)
THREADS = {"OMP_NUM_THREADS": "1"}


def _config(pair: tuple[Path, Path], start: int, end: int, version: int) -> schemas.RecomputeConfig:
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(start, end)]), recomputed_layers=end - start, quality=0.99)
    return schemas.RecomputeConfig(
        sender_model="sender", receiver_model="receiver", sender_sha256=weights_sha256(pair[0]),
        receiver_sha256=weights_sha256(pair[1]), profile_version=version, task="test", tolerance=0.05,
        chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6,
        created_at=time.time())


async def _until_plan(client, plan: str, context, tries: int = 50):
    """Prefill fresh contexts and ask over each until a reply used `plan` (configs propagate
    asynchronously); return the last reply."""
    reply = None
    for i in range(tries):
        await client.prefill("sender", context(i))
        reply = await client.ask("receiver", context(i), " q", max_new_tokens=2)
        if reply.plan == plan:
            break
    return reply


def test_published_profile_changes_a_running_receivers_group(nats, services, tiny_pair, tiny_models):
    """Without a profile the receiver runs full prefill; after a config lands in the bucket the
    same running receiver (and sender) use its group, and a newer version replaces it."""
    url = nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0]},
                                  url, env=THREADS))
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver"}, url, env=THREADS))

    async def run():
        client = await MeshClient.connect(url)
        board = client.bus.config_board()
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            before = await client.ask("receiver", CONTEXT, " q", max_new_tokens=2)
            await board.put(_config(tiny_pair, 2, 4, version=1))
            # New contexts are captured with the profiled E layer; ask until the receiver uses it.
            after = await _until_plan(client, "recompute [2,4)", lambda i: words(161 + i, offset=1))
            await board.put(_config(tiny_pair, 1, 5, version=2))
            newer = await _until_plan(client, "recompute [1,5)", lambda i: words(300 + i, offset=2))
            return before, after, newer
        finally:
            await client.close()

    before, after, newer = asyncio.run(run())
    assert before.path == "full_prefill" and "no recompute config" in (before.fallback_reason or "")
    assert after is not None and after.path == "partial" and after.plan == "recompute [2,4)"
    assert newer is not None and newer.path == "partial" and newer.plan == "recompute [1,5)"


def test_a_snapshot_right_after_puts_holds_every_config(nats, tiny_pair):
    """`snapshot()` from a fresh connection, straight after each put, returns every version put so
    far (a watcher-based read could end before entries already in flight to it)."""
    from droidmesh.shared.mesh.config_board import NatsConfigBoard, config_key

    async def run() -> list[set[str]]:
        writer = await MeshClient.connect(nats[1])
        seen = []
        try:
            for version in range(1, 9):
                cfg = _config(tiny_pair, 1, 3, version)
                await writer.bus.config_board().put(cfg)
                reader = await MeshClient.connect(nats[1])
                try:
                    seen.append(set((await NatsConfigBoard(reader.bus.nc).snapshot() or {}).keys()))
                finally:
                    await reader.close()
        finally:
            await writer.close()
        return seen

    seen = asyncio.run(run())
    for version, keys in enumerate(seen, start=1):
        assert keys == {config_key(_config(tiny_pair, 1, 3, v)) for v in range(1, version + 1)}
