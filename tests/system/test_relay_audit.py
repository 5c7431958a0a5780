"""The relay audit on a real mesh (nats-server, services as processes, the ci tier's models): the
randomized shares are honoured, and an injected quality drop (a pair config whose plan disagrees
with full prefill) is caught by the shadows, the profiler service re-profiles the pair on the
receiver's recent contexts, and the new config version reaches the running receiver."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.config_board import NatsConfigBoard
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.tasks.suite import make_rows
from droidmesh.shared.wire import schemas
from droidmesh.shared.zoo.tiers import get_recipe
from tests.system.conftest import until_indexed

pytestmark = pytest.mark.system

THREADS = {"OMP_NUM_THREADS": "1"}
TASK = "multihop_qa"
VETO = [schemas.RelayBucket(0.0, 0.5, False)]  # the audit's verdict for reusable fractions these requests never have


def _full_reuse_config(tiny_pair) -> schemas.RecomputeConfig:
    """The injected drop: full reuse, claimed as good as full prefill (on these models its greedy
    answers agree with full prefill on about a quarter of the tokens)."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[]), recomputed_layers=0, quality=1.0)
    return schemas.RecomputeConfig(
        sender_model="sender", receiver_model="receiver", sender_sha256=weights_sha256(tiny_pair[0]),
        receiver_sha256=weights_sha256(tiny_pair[1]), profile_version=1, task=TASK, tolerance=0.05, chosen=point,
        frontier=[point], full_prefill_quality=1.0, full_reuse_quality=1.0, total_layers=6, created_at=time.time())


def _event(line: str) -> dict:
    """A structlog JSON line as a dict ({} for anything else)."""
    try:
        return json.loads(line[line.index("{"):])
    except ValueError:
        return {}


def test_holdout_blind_and_shadow_shares_are_honoured(nats, services, tiny_pair, tiny_models):
    """Holdout 0.3, blind 0.2 and shadow 0.5 on a receiver whose config relays: over 60 requests the
    control count, the blind count and the relayed answers picked for a shadow each lie within 4.5
    binomial standard deviations of their expectation, and every line says its assignment and shares."""
    url, n = nats[1], 60
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 2]},
                                  url, env=THREADS))
    receiver = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver", "holdout_share": 0.3,
                                          "blind_share": 0.2, "shadow_share": 0.5, "quality_threshold": 0.0,
                                          "hold": False},  # the audit is of relaying the sender's cache
                             url, env=THREADS)
    services.append(receiver)
    context = make_rows(TASK, "test", 1, get_recipe("ci").suite)[0]["context"]
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), recomputed_layers=2, quality=1.0)
    cfg = msgspec.structs.replace(_full_reuse_config(tiny_pair), chosen=point, frontier=[point])

    async def run() -> list[schemas.GenerateReply]:
        client = await MeshClient.connect(url)
        try:
            await client.bus.config_board().put(cfg)
            await asyncio.to_thread(receiver.wait_for, lambda line: '"config_loaded"' in line, 60, "the config")
            await client.prefill("sender", context)
            await until_indexed(client, tiny_models[1], context)
            return [await client.ask("receiver", context, f" q{i}", max_new_tokens=3, timeout=60) for i in range(n)]
        finally:
            await client.close()

    replies = asyncio.run(run())
    requests = [e for e in map(_event, receiver.lines) if e.get("event") == "request"]
    arms = {a: sum(e["assignment"] == a for e in requests) for a in ("control", "blind", "treatment")}
    assert len(requests) == n and sum(arms.values()) == n, arms
    assert all(e["holdout_share"] == 0.3 and e["blind_share"] == 0.2 for e in requests)
    for arm, share in (("control", 0.3), ("blind", 0.2)):
        assert abs(arms[arm] - n * share) <= 4.5 * (n * share * (1 - share)) ** 0.5, arms
    held_out = [r for r in replies if "holdout" in (r.fallback_reason or "")]
    assert len(held_out) == arms["control"] and all(r.path == "full_prefill" for r in held_out)
    relayed = [e for e in requests if e["path"] == "partial"]
    shadowed = sum(e["shadowed"] for e in relayed)
    assert relayed and not any(e["shadowed"] for e in requests if e["path"] != "partial")
    assert abs(shadowed - len(relayed) * 0.5) <= 4.5 * (len(relayed) * 0.25) ** 0.5, (shadowed, len(relayed))


def test_a_quality_drop_is_reprofiled_and_the_new_config_reaches_the_running_receiver(nats, services, tiny_pair,
                                                                                      tiny_models):
    """Every relayed request shadowed; once 2 to 4 shadows average below 0.9 agreement the receiver
    logs quality_drift, asks the profiler with its recent rows, and loads the newer version it
    publishes (no restart), which keeps the audit's relay buckets; later requests run the new plan."""
    url = nats[1]
    services.append(start_service("profiler", {"models": [f"sender={tiny_pair[0]}", f"receiver={tiny_pair[1]}"]},
                                  url, env=THREADS))
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 2, 4]},
                                  url, env=THREADS))
    receiver = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver", "shadow_share": 1.0,
                                          "quality_threshold": 0.9, "quality_window": 4, "hold": False}, url, env=THREADS)
    services.append(receiver)
    rows = make_rows(TASK, "test", 40, get_recipe("ci").suite)

    async def run() -> tuple[list[schemas.GenerateReply], str, schemas.RecomputeConfig]:
        client = await MeshClient.connect(url)
        try:
            await client.bus.config_board().put(msgspec.structs.replace(_full_reuse_config(tiny_pair), relay=VETO))
            receiver.wait_for(lambda line: '"config_loaded"' in line, 60, "the injected config")
            replies, loaded = [], ""
            for row in rows:
                await client.prefill("sender", row["context"])
                await until_indexed(client, tiny_models[1], row["context"])
                replies.append(await client.ask("receiver", row["context"], row["input"], max_new_tokens=6, timeout=120))
                if any(_event(line).get("event") == "reprofile_requested" for line in list(receiver.lines)):
                    break
            loaded = await asyncio.to_thread(receiver.wait_for, lambda line: _event(line).get("event") == "config_loaded"
                                             and _event(line).get("version", 1) > 1, 600, "the re-profiled config")
            row = rows[len(replies)]
            await client.prefill("sender", row["context"])
            await until_indexed(client, tiny_models[1], row["context"])
            replies.append(await client.ask("receiver", row["context"], row["input"], max_new_tokens=6, timeout=120))
            board = client.bus.config_board()
            assert isinstance(board, NatsConfigBoard)
            held = [c for c in ((await board.snapshot()) or {}).values() if isinstance(c, schemas.RecomputeConfig)]
            return replies, loaded, max(held, key=lambda c: c.profile_version)
        finally:
            await client.close()

    replies, loaded, newest = asyncio.run(run())
    events = [_event(line).get("event") for line in receiver.lines]
    assert "quality_drift" in events and "reprofile_done" in events, receiver.lines[-20:]
    # relayed by the injected plan until the alarm; held (own prefill) after it, until the new config
    assert all(r.plan == "full reuse" or "quality_hold" in (r.fallback_reason or "") for r in replies[:-1])
    assert sum(r.plan == "full reuse" for r in replies) >= 2  # the watch judges from half its window
    assert _event(loaded)["version"] > 1
    assert newest.profile_version == _event(loaded)["version"] and newest.relay == VETO  # the audit's verdicts kept
    assert replies[-1].plan != "full reuse" and replies[-1].path in ("partial", "full_prefill"), replies[-1]
