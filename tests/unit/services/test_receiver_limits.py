"""Receiver limits and the per-holder circuit breaker: breaker states, position and budget checks,
load shedding, content-keyed de-duplication, decoding stopped at the deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from droidmesh.services.receiver.breaker import Breaker
from droidmesh.services.receiver.checks import check_positions, deadline_of
from droidmesh.services.receiver.holders import unreachable
from droidmesh.shared.errors import BadRequestError, MissingLayerError, PeerUnreachableError, TransferError
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.mesh.client import MeshClient, MeshError
from droidmesh.shared.wire.generation import GenerateRequest
from tests.unit.services.test_receiver_reuse import CONTEXT, QUESTION, mesh


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_n_failures_and_probes_once_after_cooldown():
    """N consecutive failures open the circuit; after the cool-down exactly one probe goes; its success closes it."""
    clock = Clock()
    b = Breaker(3, 10.0, clock=clock)
    assert not b.failure("s") and not b.failure("s") and b.allow("s")
    assert b.failure("s") and b.state("s") == "open" and not b.allow("s")
    clock.now = 10.0
    assert b.allow("s") and not b.allow("s")  # one probe at a time
    b.success("s")
    assert b.state("s") == "closed" and b.allow("s")


def test_breaker_failed_probe_reopens_and_hard_failure_opens_at_once():
    """A failed half-open probe re-opens for a full cool-down; an unreachable peer opens the circuit on its first failure."""
    clock = Clock()
    b = Breaker(3, 5.0, clock=clock)
    assert b.failure("dead", hard=True) and not b.allow("dead")
    clock.now = 5.0
    assert b.allow("dead")
    assert b.failure("dead") and not b.allow("dead")
    clock.now = 9.0
    assert not b.allow("dead")
    b.release("other")  # unknown holders are fine
    assert b.allow("other") and b.open_holders() == ["dead"]


def test_breaker_success_resets_the_count_and_memory_is_bounded():
    """A success between failures resets the count; at most max_holders holders are tracked."""
    b = Breaker(2, 1.0, max_holders=8)
    b.failure("s")
    b.success("s")
    assert not b.failure("s") and b.state("s") == "closed"
    for i in range(100):
        b.failure(f"h{i}")
    assert len(b._holders) <= 8


def test_a_layer_that_never_arrives_because_the_holder_is_unreachable_is_a_hard_failure():
    """The engine's MissingLayerError raised from a PeerUnreachableError opens the circuit at once;
    a plain missing layer or transfer error does not."""
    def chained() -> MissingLayerError:
        try:
            raise PeerUnreachableError("connect to ucx://a failed")
        except PeerUnreachableError as cause:
            try:
                raise MissingLayerError("E of layer 1 will not arrive") from cause
            except MissingLayerError as e:
                return e

    assert unreachable(PeerUnreachableError("x")) and unreachable(chained())
    assert not unreachable(MissingLayerError("late")) and not unreachable(TransferError("bad bytes"))


def test_prompt_past_the_models_positions_is_refused(tiny_models):
    """A prompt (plus new tokens) longer than max_position_embeddings is a bad request, named clearly."""
    model = tiny_models[1]
    limit = model.config.max_position_embeddings
    check_positions(model, limit - 8, 8)
    with pytest.raises(BadRequestError, match="max_position_embeddings"):
        check_positions(model, limit, 1)


def test_budget_wins_over_a_skewed_absolute_deadline():
    """budget_s counts from arrival whatever the client's clock says; hostile values are refused."""
    now = time.monotonic()
    skewed = GenerateRequest(request_id="r", context="c", question="q", deadline=time.time() - 3600,
                             budget_s=30.0)
    assert deadline_of(skewed, now, 60.0) == now + 30.0
    assert deadline_of(GenerateRequest(request_id="r", context="c", question="q"), now, 60.0) == now + 60.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(BadRequestError):
            deadline_of(GenerateRequest(request_id="r", context="c", question="q", budget_s=bad), now, 60.0)


def test_decoding_stops_when_the_deadline_passes(tiny_models):
    """A deadline already passed ends decoding after the first token, finish_reason "length"."""
    model = tiny_models[1]
    ids = model.tokenizer.encode(CONTEXT)
    gen = generate(model, ids, ReusePlan.full_prefill(), max_new_tokens=16, deadline=time.monotonic() - 1)
    assert len(gen.tokens) == 1 and gen.finish_reason == "length"


def test_known_id_with_other_content_gets_its_own_answer(tiny_pair, tiny_models):
    """Two different requests under one id are answered each on its own content, not from the reply cache."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            client = MeshClient(bus)
            a = await client.ask("receiver", CONTEXT, QUESTION, max_new_tokens=6, request_id="same", mode="full_prefill")
            b = await client.ask("receiver", "entirely other words", " and another question", max_new_tokens=6,
                                 request_id="same", mode="full_prefill")
            c = await client.ask("receiver", "entirely other words", " and another question", max_new_tokens=6,
                                 mode="full_prefill")
            return a, b, c

    a, b, c = asyncio.run(run())
    assert b.prompt_tokens == c.prompt_tokens != a.prompt_tokens and b.token_ids == c.token_ids


def test_requests_past_the_queue_bound_are_refused_overloaded(tiny_pair, tiny_models):
    """With max_queued_requests=1, a request arriving while one is held is refused "overloaded" at once."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, _, receiver):
            receiver.state.cfg = dataclasses.replace(receiver.cfg, max_queued_requests=1)
            client = MeshClient(bus)
            first = asyncio.create_task(client.ask("receiver", CONTEXT, QUESTION, max_new_tokens=32,
                                                   mode="full_prefill"))
            while receiver.state.inflight == 0:
                await asyncio.sleep(0)
            with pytest.raises(MeshError) as refused:
                await client.ask("receiver", CONTEXT, " another", max_new_tokens=2, mode="full_prefill")
            return (await first), refused.value

    first, refused = asyncio.run(run())
    assert first.path == "full_prefill" and refused.code == "overloaded"

