"""Server-style generation through the real mesh: nats-server, broker, sender and receiver as
separate processes on the zoo's ci tier, streamed through `MeshClient.stream`."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.shared.mesh.client import MeshClient, MeshError
from droidmesh.shared.model import text
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateChunk, GenerateRequest, Sampling
from tests.system.conftest import health_port, until_indexed, words

pytestmark = pytest.mark.system

CONTEXT = words(400)
QUESTION = " what is gamma"
THREADS = {"OMP_NUM_THREADS": "1"}


async def _stream(client: MeshClient, **kwargs) -> tuple[list[GenerateChunk], schemas.GenerateReply]:
    chunks, replies = [], []
    async for item in client.stream("receiver", CONTEXT, QUESTION, **kwargs):
        (chunks if isinstance(item, GenerateChunk) else replies).append(item)
    assert len(replies) == 1, replies
    return chunks, replies[0]


async def _session(url: str, model) -> dict:
    client = await MeshClient.connect(url)
    out: dict = {}
    try:
        await client.prefill("sender", CONTEXT)
        await until_indexed(client, model, CONTEXT)
        out["greedy"] = await _stream(client, max_new_tokens=12)
        full = out["greedy"][1]
        stop = next(s for s in (text.decode(model.tokenizer, [t]) for t in full.token_ids[3:]) if s.strip())
        out["stop"] = stop, await _stream(client, max_new_tokens=12, sampling=Sampling(stop=[stop]))
        hot = Sampling(temperature=1.2, top_p=0.9, seed=1234)
        out["seeded"] = [await _stream(client, max_new_tokens=10, sampling=hot) for _ in range(2)]
        bad = []
        for fields in (dict(stream_subject="dm.cache.available"), dict(sampling=Sampling(temperature=5.0))):
            req = GenerateRequest(request_id=f"bad{len(bad)}", context=CONTEXT, question=QUESTION, **fields)
            data = await client.bus.request(subjects.receiver_generate("receiver"), schemas.encode(req), timeout=30)
            bad.append(schemas.decode(data, schemas.ErrorReply))
        out["bad"] = bad
        try:
            await _stream(client, sampling=Sampling(top_p=2.0))
        except MeshError as e:
            out["stream_error"] = e
        out["after"] = await client.ask("receiver", CONTEXT, QUESTION, max_new_tokens=12)
    finally:
        await client.close()
    return out


def test_streaming_stops_and_sampling_through_the_mesh(nats, services, tiny_pair, tiny_models):
    """Chunks concatenate to the reply (reuse path), a stop string cuts the answer before it,
    one seed gives one answer, and bad requests get error replies while the receiver keeps serving."""
    url = nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 1, 2],
                                             "heartbeat_s": 0.5}, url, env=THREADS))
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver",
                                               "default_group": [1, 2]}, url, env=THREADS))
    out = asyncio.run(_session(url, tiny_models[1]))

    chunks, reply = out["greedy"]
    assert reply.path == "partial" and reply.reused_tokens > 0 and reply.prompt_tokens > reply.reused_tokens
    assert [c.index for c in chunks] == list(range(len(chunks))) and chunks
    assert "".join(c.text for c in chunks) == reply.text

    stop, (stop_chunks, stopped) = out["stop"]
    assert stopped.text == reply.text[: reply.text.index(stop)] and stopped.finish_reason == "stop"
    assert "".join(c.text for c in stop_chunks) == stopped.text

    (_, a), (_, b) = out["seeded"]
    assert a.token_ids == b.token_ids and a.text == b.text

    assert [(e.code, e.request_id) for e in out["bad"]] == [("bad_request", "bad0"), ("bad_request", "bad1")]
    assert "stream_subject" in out["bad"][0].message and "temperature" in out["bad"][1].message
    assert "top_p" in str(out["stream_error"])
    assert out["after"].token_ids == reply.token_ids  # still serving, and greedy is deterministic


@pytest.mark.parametrize("pool_tokens", [0, 512], ids=["ragged", "decode pool"])
def test_concurrent_requests_decode_in_one_batch_and_answer_as_alone(nats, services, tiny_pair, tiny_models,
                                                                     pool_tokens):
    """A receiver decoding requests together (max_batch 4, six sent at once: full prefills of
    different contexts and limits, and full reuses of the sender's context) answers each with
    the tokens it gets when asked alone afterwards; its metrics count the shared steps. A request
    for n = 3 samples gets, as sample i, what a request of its own with seed + i gets. With a
    decode pool (`decode_pool_tokens`) the same holds, the pool allocated at start."""
    from tests.system.test_operations import _samples

    url = nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": tiny_pair[0], "model_id": "sender", "e_layers": [0, 1, 2],
                                             "heartbeat_s": 0.5}, url, env=THREADS))
    receiver = start_service("receiver", {"model_path": tiny_pair[1], "model_id": "receiver", "default_group": [1, 2],
                                          "max_batch": 4, "metrics_port": 0, "hold": False,
                                          "decode_pool_tokens": pool_tokens}, url, env=THREADS)
    services.append(receiver)
    assert [(e["slots"], e["tokens"]) for e in receiver.events("decode_pool")] == ([(4, 512)] if pool_tokens else [])
    asks = [(words(60 + 25 * i, offset=3 * i), f" q{i}", 10 + 3 * i, "full_prefill") for i in range(4)]
    asks += [(CONTEXT, f" who {i}", 12, "full_reuse") for i in range(2)]  # forced: no relay decision to race

    async def run() -> tuple:
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            together = await asyncio.gather(*(client.ask("receiver", c, q, max_new_tokens=n, mode=m)
                                              for c, q, n, m in asks))
            alone = [await client.ask("receiver", c, q, max_new_tokens=n, mode=m) for c, q, n, m in asks]
            hot = dict(temperature=1.1, top_p=0.95, stop=["zzz"])
            n3 = await client.ask("receiver", CONTEXT, " why", max_new_tokens=9, n=3, mode="full_reuse",
                                  sampling=Sampling(seed=40, logprobs=1, **hot))
            each = [await client.ask("receiver", CONTEXT, " why", max_new_tokens=9, mode="full_reuse",
                                     sampling=Sampling(seed=40 + i, **hot)) for i in range(3)]
            return list(together), alone, n3, each
        finally:
            await client.close()

    together, alone, n3, each = asyncio.run(run())
    # n samples: one prefill, sample i drawing from seed + i, each what its own request gets
    assert [n3.token_ids, *(x.token_ids for x in n3.samples)] == [x.token_ids for x in each]
    assert [n3.text, *(x.text for x in n3.samples)] == [x.text for x in each]
    assert all(x.logprobs is not None and len(x.logprobs) == len(x.token_ids) for x in n3.samples)
    for a, b in zip(together, alone, strict=True):
        assert a.path == b.path and a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert {r.path for r in together} == {"full_prefill", "full_reuse"}
    m = _samples(health_port(receiver))
    steps, rows = m[("dm_decode_steps_total", ())], m[("dm_decode_rows_total", ())]
    rows_n3 = sum(len(x) - 1 for x in [n3.token_ids, *(x.token_ids for x in n3.samples)])
    assert rows == sum(len(r.token_ids) - 1 for r in together + alone + each) + rows_n3  # each its own steps
    assert 0 < steps <= rows
