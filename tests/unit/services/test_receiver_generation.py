"""Server-style generation on a receiver, in one process (in-process bus and bulk channel, real
engine on tiny checkpoints): streaming, stop strings, sampling, chat and completions prompts,
and request checks."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.shared.mesh.client import MeshClient, MeshError
from droidmesh.shared.model import text
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateChunk, GenerateRequest, Sampling
from tests.unit.services.test_receiver_reuse import CONTEXT, QUESTION, mesh

RECEIVER = "receiver"


async def _prefilled(bus) -> MeshClient:
    client = MeshClient(bus)
    await client.prefill("sender", CONTEXT)
    await bus.settle()
    return client


async def _collect(client: MeshClient, *args, **kwargs) -> tuple[list[GenerateChunk], schemas.GenerateReply]:
    chunks, replies = [], []
    async for item in client.stream(RECEIVER, *args, **kwargs):
        (chunks if isinstance(item, GenerateChunk) else replies).append(item)
    assert len(replies) == 1
    return chunks, replies[0]


def test_stream_chunks_concatenate_to_the_reply(tiny_pair, tiny_models):
    """Streamed over the reuse path: chunks come in index order, their text concatenates to the
    reply's text and their ids to its tokens' prefix; the tokens equal a plain ask's."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            client = await _prefilled(bus)
            streamed = await _collect(client, CONTEXT, QUESTION, max_new_tokens=8)
            return streamed, await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=8)

    (chunks, reply), plain = asyncio.run(run())
    assert reply.path == "partial" and reply.token_ids == plain.token_ids and reply.text == plain.text
    assert [c.index for c in chunks] == list(range(len(chunks))) and chunks
    assert "".join(c.text for c in chunks) == reply.text
    ids = [t for c in chunks for t in c.token_ids]
    assert reply.token_ids[: len(ids)] == ids
    ctx_len = len(text.context_ids(tiny_models[1].tokenizer, CONTEXT))
    assert reply.reused_tokens == ctx_len and reply.prompt_tokens > ctx_len
    assert reply.finish_reason in ("stop", "length")


def test_stop_string_ends_the_answer_before_it(tiny_pair, tiny_models):
    """A stop string taken from the greedy answer cuts the reply right before it, finish "stop"."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            client = await _prefilled(bus)
            full = await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=12, mode="full_prefill")
            stop = next(s for s in (text.decode(tiny_models[1].tokenizer, [t]) for t in full.token_ids[3:]) if s)
            cut = await _collect(client, CONTEXT, QUESTION, max_new_tokens=12, mode="full_prefill",
                                 sampling=Sampling(stop=[stop]))
            return full, stop, cut

    full, stop, (chunks, reply) = asyncio.run(run())
    assert reply.text == full.text[: full.text.index(stop)]
    assert reply.finish_reason == "stop" and "".join(c.text for c in chunks) == reply.text
    assert len(reply.token_ids) < len(full.token_ids)


def test_seeded_sampling_is_reproducible(tiny_pair, tiny_models):
    """The same seed gives the same answer; temperature 0 equals greedy."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            client = await _prefilled(bus)
            hot = Sampling(temperature=1.5, top_p=0.95, seed=7)
            a = await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=10, sampling=hot)
            b = await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=10, sampling=hot)
            greedy = await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=10)
            cold = await client.ask(RECEIVER, CONTEXT, QUESTION, max_new_tokens=10,
                                    sampling=Sampling(temperature=0.0, seed=3))
            return a, b, greedy, cold

    a, b, greedy, cold = asyncio.run(run())
    assert a.token_ids == b.token_ids and a.path == b.path == "partial"
    assert cold.token_ids == greedy.token_ids


def test_completions_and_chat_prompts_reuse_the_cached_document(tiny_pair, tiny_models):
    """A completions prompt (question "") and a chat whose first message is the document both
    reuse the sender's cache of the document."""
    ctx_len = len(text.context_ids(tiny_models[1].tokenizer, CONTEXT))

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            client = await _prefilled(bus)
            completion = await client.ask(RECEIVER, CONTEXT + QUESTION, "", max_new_tokens=4)
            chat = await client.ask(RECEIVER, "", "", max_new_tokens=4, chat=[
                schemas.ChatMessage("system", CONTEXT), schemas.ChatMessage("user", QUESTION)])
            return completion, chat

    completion, chat = asyncio.run(run())
    for reply in (completion, chat):
        assert reply.path == "partial" and reply.reused_tokens == ctx_len, reply


BAD = [
    (dict(sampling=Sampling(temperature=5.0)), "temperature"),
    (dict(sampling=Sampling(top_p=0.0)), "top_p"),
    (dict(sampling=Sampling(stop=["a", "b", "c", "d", "e"])), "stop"),
    (dict(max_new_tokens=5000), "max_new_tokens_limit"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stream_subject="dm.cache.available"), "stream_subject"),
    (dict(stream_subject="_INBOX.>"), "stream_subject"),
    (dict(chat=[]), "chat"),
    (dict(chat=[schemas.ChatMessage("user", "hi")], context="doc"), "context and question must be empty"),
    (dict(context="x" * 500_001), "max_prompt_chars"),
]


@pytest.mark.parametrize("fields,match", BAD, ids=[m for _, m in BAD])
def test_bad_requests_get_an_error_reply(tiny_pair, tiny_models, fields, match):
    """Each out-of-bounds request is answered with a bad_request ErrorReply naming the field."""

    async def run() -> bytes:
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            req = GenerateRequest(**{"request_id": "bad", "context": CONTEXT, "question": QUESTION, **fields})
            return await bus.request(subjects.receiver_generate(RECEIVER), schemas.encode(req), timeout=30)

    err = schemas.decode(asyncio.run(run()), schemas.ErrorReply)
    assert err.code == "bad_request" and match in err.message, err


class DroppingBus:
    """The receiver's bus, except that publishing a chunk always fails."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def publish(self, subject: str, data: bytes) -> None:
        if subject.startswith(f"{subjects.INBOX_PREFIX}."):
            raise ConnectionError("publish refused")
        await self.inner.publish(subject, data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_failed_chunk_publishes_do_not_fail_the_request(tiny_pair, tiny_models):
    """When every chunk publish fails the client still gets the whole reply, and no chunk."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, _, receiver):
            receiver.state.bus = DroppingBus(receiver.state.bus)
            client = await _prefilled(bus)
            return await _collect(client, CONTEXT, QUESTION, max_new_tokens=6)

    chunks, reply = asyncio.run(run())
    assert chunks == [] and reply.path == "partial" and len(reply.token_ids) >= 1


def test_mesh_error_ends_a_stream(tiny_pair, tiny_models):
    """A refused streamed request raises MeshError from the iterator."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            await _collect(MeshClient(bus), CONTEXT, QUESTION, sampling=Sampling(temperature=9.0))

    with pytest.raises(MeshError, match="temperature"):
        asyncio.run(run())
