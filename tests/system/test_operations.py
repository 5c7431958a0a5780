"""Operations: metrics endpoints, health probes, graceful SIGTERM with requests in flight."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.launch import start_service
from tests.system.conftest import health_port, http_get, until_indexed, words

pytestmark = pytest.mark.system

CONTEXT = words(240)
THREADS = {"OMP_NUM_THREADS": "1"}


def _samples(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} scraped from a /metrics endpoint."""
    status, body = http_get(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_metrics_after_a_small_workload(nats, services, tiny_pair, tiny_models):
    """Each service's /metrics carries its series with the right counts; probes answer."""
    url = nats[1]
    broker = start_service("cache_broker", {"metrics_port": 0}, url, env=THREADS)
    sender = start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [2],
                                      "metrics_port": 0}, url, env=THREADS)
    receiver = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver", "default_group": [2, 4],
                                          "metrics_port": 0, "hold": False}, url, env=THREADS)  # counts the sender's pulls
    services.extend([broker, sender, receiver])

    async def run() -> list:
        client = await MeshClient.connect(url)
        try:
            out = [await client.ask("receiver", CONTEXT, " q", max_new_tokens=2, mode="full_prefill")]
            out.append(await client.ask("receiver", words(40, offset=11), " q", max_new_tokens=2))  # miss
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            for i in range(3):
                out.append(await client.ask("receiver", CONTEXT, f" q{i}", max_new_tokens=2))  # hits
            return out
        finally:
            await client.close()

    replies = asyncio.run(run())
    assert [r.path for r in replies] == ["full_prefill", "full_prefill", "partial", "partial", "partial"]
    r = _samples(health_port(receiver))
    assert r[("dm_requests_total", (("path", "partial"), ("reason", "")))] == 3
    assert r[("dm_requests_total", (("path", "full_prefill"), ("reason", "forced")))] == 1
    assert r[("dm_requests_total", (("path", "full_prefill"), ("reason", "no_cache")))] == 1
    assert r[("dm_ttft_seconds_count", (("path", "partial"),))] == 3
    assert r[("dm_cache_lookups_total", (("result", "hit"),))] == 3
    assert r[("dm_cache_lookups_total", (("result", "miss"),))] == 1
    assert r[("dm_bytes_pulled_total", ())] == sum(x.bytes_pulled for x in replies) > 0
    s = _samples(health_port(sender))
    assert s[("dm_prefills_total", ())] == 1 and s[("dm_store_contexts", ())] == 1 and s[("dm_store_bytes", ())] > 0
    b = _samples(health_port(broker))
    assert b[("dm_index_contexts", ())] == 1
    for proc in (broker, sender, receiver):
        assert http_get(health_port(proc), "/livez")[0] == 200 and http_get(health_port(proc), "/readyz")[0] == 200


def test_sigterm_drains_in_flight_requests(nats, services, tiny_pair):
    """SIGTERM to a receiver with requests in flight: every request is answered, by it or its
    sibling on the queue group, and the stopped receiver exits cleanly (status 0)."""
    url = nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [2]},
                                  url, env=THREADS))
    victim = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver", "default_group": [2, 4]},
                           url, name="receiver-a", env=THREADS)
    services.append(victim)
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver",
                                               "default_group": [2, 4]}, url, name="receiver-b", env=THREADS))

    async def run() -> list:
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            tasks = [asyncio.create_task(client.ask("receiver", CONTEXT, f" q{i}", max_new_tokens=8, timeout=60,
                                                    attempt_s=10)) for i in range(16)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            victim.signal_stop()  # SIGTERM while the rest are in flight
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    replies = asyncio.run(run())
    assert len(replies) == 16 and all(len(r.token_ids) >= 1 for r in replies)
    rc = victim.stop(grace=30)
    assert rc == 0, victim.tail(40)
    served = {r.served_by.rsplit("-", 1)[0] for r in replies}
    assert served == {"receiver"}
    assert victim.events("stopped")
