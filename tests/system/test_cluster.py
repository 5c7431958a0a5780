"""Beyond one server: the mesh on a 3-node NATS cluster survives losing the node it is connected to."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.config_board import CLUSTER_REPLICAS, config_key
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import NatsCluster, start_nats_cluster, start_service
from droidmesh.shared.wire import schemas, subjects
from tests.system.conftest import until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.fault]

CONTEXT = words(400)
QUESTION = " what is gamma"
THREADS = {"OMP_NUM_THREADS": "1"}
WORKERS = 2  # concurrent request streams
WARM = 4  # answers before the kill
AFTER = 4  # answers to requests sent after every service reconnected
NAMES = {"broker": "droidmesh-broker", "sender": "droidmesh-sender", "receiver": "droidmesh-receiver"}


def _config(pair: tuple[Path, Path], version: int) -> schemas.RecomputeConfig:
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(1, 2)]), recomputed_layers=1, quality=0.99)
    return schemas.RecomputeConfig(
        sender_model="sender", receiver_model="receiver", sender_sha256=weights_sha256(pair[0]),
        receiver_sha256=weights_sha256(pair[1]), profile_version=version, task="test", tolerance=0.05,
        chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6,
        created_at=time.time())


@pytest.fixture
def cluster(tmp_path) -> Iterator[NatsCluster]:
    c = start_nats_cluster(3, store_dir=str(tmp_path / "js"), log_dir=tmp_path)
    yield c
    c.stop()


def _loaded(version: int):
    return lambda line: '"config_loaded"' in line and f'"version": {version}' in line


async def _lead_from(client: MeshClient, node: str, deadline_s: float = 90.0) -> None:
    """Move the config bucket's stream leader to `node` (a JetStream step-down with a preferred
    placement), so that losing `node` also forces a leader election for the bucket. A step-down
    starts an election that can take seconds on a busy machine (API calls time out or answer 503
    meanwhile): ask again, paced, until the deadline."""
    js, stream = client.bus.nc.jetstream(), f"KV_{subjects.CONFIG_BUCKET}"  # type: ignore[attr-defined]
    end, answers = time.monotonic() + deadline_s, []
    while time.monotonic() < end:
        try:
            if (await js.stream_info(stream)).cluster.leader == node:
                return
            reply = await client.bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",  # type: ignore[attr-defined]
                                                json.dumps({"placement": {"preferred": node}}).encode(), timeout=5)
            answers.append(reply.data[:200])
        except Exception as e:
            answers.append(repr(e)[:200])
        await asyncio.sleep(1.0)
    raise TimeoutError(f"the config bucket's leader never moved to {node}: {answers[-3:]}")


async def _entry(client: MeshClient, key: str, deadline_s: float = 60.0) -> tuple[int, bytes, int, str, list[str]]:
    """`key`'s (revision, value) in the config bucket, the bucket's replicas, its leader node and the
    other nodes holding it. While the cluster elects a leader (for the bucket, or JetStream's own
    meta leader after a node is lost), API calls time out or answer 503: ask again, paced, until
    the deadline; a busy machine can stretch an election to seconds."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import ServiceUnavailableError

    js = client.bus.nc.jetstream()  # type: ignore[attr-defined]
    end = time.monotonic() + deadline_s
    while True:
        try:
            entry = await (await js.key_value(subjects.CONFIG_BUCKET)).get(key)
            info = await js.stream_info(f"KV_{subjects.CONFIG_BUCKET}")
            if info.cluster.leader:
                return (entry.revision, entry.value, info.config.num_replicas, info.cluster.leader,
                        [r.name for r in info.cluster.replicas or []])
        except (NatsTimeout, ServiceUnavailableError):
            if time.monotonic() > end:
                raise
        if time.monotonic() > end:
            raise AssertionError("the config bucket has no leader")
        await asyncio.sleep(0.5)


def test_killing_the_connected_node_loses_no_request(cluster, services, tiny_pair, tiny_models):
    """SIGKILL the NATS node the receiver is connected to under a request stream: every request is
    answered, the replicated config bucket keeps its entry, services reconnect and keep following it."""
    procs = {}
    for role, args in [("broker", {}),
                       ("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 1, 2], "heartbeat_s": 0.5}),
                       ("receiver", {"model_path": tiny_pair[1], "model_id": "receiver"})]:
        procs[role] = start_service("cache_broker" if role == "broker" else role, args, cluster.url, name=role, env=THREADS)
        services.append(procs[role])
    sent: list[str] = []
    answered: dict[str, schemas.GenerateReply] = {}
    failed: dict[str, str] = {}
    report: dict[str, object] = {}

    async def run() -> None:
        client = await MeshClient.connect(cluster.url)
        board = client.bus.config_board()
        try:
            await board.put(_config(tiny_pair, version=1))
            for role in ("sender", "receiver"):
                await asyncio.to_thread(procs[role].wait_for, _loaded(1), 30, "config v1")
            key = config_key(_config(tiny_pair, version=1))
            before = await _entry(client, key)
            assert before[2] == CLUSTER_REPLICAS and len({before[3], *before[4]}) == CLUSTER_REPLICAS, before
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)

            phase = [0]  # 0: before the kill, 1: failing over, 2: every service reconnected
            after: list[str] = []
            progress = asyncio.Condition()

            async def worker(w: int) -> None:
                i = 0
                while phase[0] < 2 or len(after) < AFTER:
                    rid, started = f"w{w}-{i}", phase[0]
                    i += 1
                    sent.append(rid)
                    try:
                        answered[rid] = await client.ask("receiver", CONTEXT, QUESTION, max_new_tokens=2, timeout=45,
                                                         attempt_s=2.0, request_id=rid)
                    except Exception as e:  # a lost request: the test fails on it below
                        failed[rid] = repr(e)
                    if started == 2:
                        after.append(rid)
                    async with progress:
                        progress.notify_all()

            stream = [asyncio.create_task(worker(w)) for w in range(WORKERS)]
            async with progress:
                await progress.wait_for(lambda: len(answered) + len(failed) >= WARM)
            (victim,) = cluster.nodes_of(NAMES["receiver"])
            moving = [r for r, name in NAMES.items() if victim in cluster.nodes_of(name)]
            await _lead_from(client, cluster.names[victim])
            report.update(victim=cluster.names[victim], bucket_leader=(await _entry(client, key))[3], moving=moving,
                          client_moved=victim in cluster.nodes_of("droidmesh-client"),
                          sent_before_kill=len(sent))
            phase[0] = 1
            cluster.procs[victim].kill()
            for role in moving:
                await asyncio.to_thread(procs[role].wait_for, lambda l: '"nats_reconnected"' in l, 30, "a reconnect")
            phase[0] = 2
            await asyncio.gather(*stream)

            now = await _entry(client, key)
            report.update(bucket_before=before[2:], bucket_after=now[2:])
            assert now[:2] == before[:2]  # same revision, same bytes
            await board.put(_config(tiny_pair, version=2))  # watchers that moved still follow the bucket
            for role in ("sender", "receiver"):
                await asyncio.to_thread(procs[role].wait_for, _loaded(2), 30, "config v2 after the failover")
        finally:
            await client.close()

    asyncio.run(run())
    print("cluster failover:", report, f"sent {len(sent)} answered {len(answered)}",
          {p: sum(r.path == p for r in answered.values()) for p in ("partial", "fallback", "full_prefill")})
    assert not failed, failed
    assert sorted(answered) == sorted(sent)
    assert all(r.token_ids for r in answered.values())
    assert report["bucket_after"][1] != report["victim"]  # type: ignore[index]  # a surviving node leads the bucket
    for role, name in NAMES.items():  # every service is connected again, to a surviving node
        assert cluster.nodes_of(name), role
    assert procs["receiver"].events("nats_reconnected")
