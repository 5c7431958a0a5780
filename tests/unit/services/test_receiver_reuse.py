"""The receiver's reuse path end to end in one process: in-process bus, config board and bulk
channel (no sockets), real engine on tiny checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import msgspec
import pytest
import torch

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.service import ReceiverService
from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.service import SenderService
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.config_board import InMemoryConfigBoard
from droidmesh.shared.model import text
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.bulk import BulkClient
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.schemas import CodecParams, TensorHeader

CONTEXT = " ".join(["alpha beta gamma delta"] * 12)
QUESTION = " what is gamma"


class XorCodec:
    """A toy lossless codec: every byte XOR 0x5A. Counts what it decodes."""

    name = "toy-xor"
    decoded = 0

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        return codecs.payload_view(t.contiguous()) ^ 0x5A, {"key": 0x5A}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        codecs.payload_view(out).copy_(payload ^ int(header.codec_params["key"]))
        XorCodec.decoded += 1

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        return codecs.nbytes_of(shape, dtype)


@contextlib.asynccontextmanager
async def mesh(tiny_pair, tiny_models, default_group=(2, 6), transport="inproc", holdout_share=0.0, shadow_share=0.0,
               blind_share=0.0, hold=False, **receiver_kw):
    """Broker, sender and receiver in one loop. The receiver holds nothing of its own by default:
    these tests reuse the sender's cache, which a repeat would otherwise find in the receiver's own
    store (test_receiver_holding.py covers that)."""
    bus, board = InProcessBus(), InMemoryConfigBoard()
    scfg = SenderConfig(model_path=str(tiny_pair[0]), model_id="sender", e_layers=(0, 2), heartbeat_s=0.2,
                        transport=transport)
    rcfg = ReceiverConfig(model_path=str(tiny_pair[1]), model_id="receiver", default_group=default_group,
                          transport=transport, holdout_share=holdout_share, shadow_share=shadow_share,
                          blind_share=blind_share, hold=hold, **receiver_kw)
    # The sender is never expired here (ttl_factor): on a loaded host one request's compute can hold
    # this one loop past three 0.2 s heartbeats, and a lookup would find no holder and fall back to
    # full prefill, a timing decision none of these tests is about.
    async with BrokerService(BrokerConfig(ttl_factor=10_000.0), bus=bus), \
            SenderService(scfg, bus=bus, model=tiny_models[0], board=board), \
            ReceiverService(rcfg, bus=bus, model=tiny_models[1], board=board) as receiver:
        yield bus, board, receiver


async def _ask(bus, subject, msg, kind):
    return schemas.decode(await bus.request(subject, schemas.encode(msg), timeout=30), kind)


async def _prefill(bus) -> None:
    """The sender captures CONTEXT; returns once its availability event has been handled."""
    await _ask(bus, subjects.sender_prefill("sender"), schemas.PrefillRequest(request_id="p", context=CONTEXT),
               schemas.PrefillReply)
    await bus.settle()


async def _generate(bus, request_id: str = "r", max_new_tokens: int = 6) -> schemas.GenerateReply:
    return await _ask(bus, subjects.receiver_generate("receiver"),
                      GenerateRequest(request_id=request_id, context=CONTEXT, question=QUESTION,
                                      max_new_tokens=max_new_tokens), schemas.GenerateReply)


async def _prefill_and_ask(bus) -> schemas.GenerateReply:
    await _prefill(bus)
    return await _generate(bus)


def _pair_config(tiny_pair, point: schemas.FrontierPoint, **fields) -> schemas.RecomputeConfig:
    """A version-1 config of the tiny pair whose only plan is `point`."""
    base = dict(sender_model="sender", receiver_model="receiver", sender_sha256=weights_sha256(tiny_pair[0]),
                receiver_sha256=weights_sha256(tiny_pair[1]), profile_version=1, task="t", tolerance=0.05,
                chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6,
                created_at=time.time())
    return schemas.RecomputeConfig(**{**base, **fields})


def _engine_tokens(tiny_models, plan: ReusePlan) -> list[int]:
    sender_m, receiver_m = tiny_models
    ctx, q = text.prompt_ids(receiver_m.tokenizer, CONTEXT, QUESTION)
    captured = capture_prefill(sender_m, ctx, [0, 2])
    return generate(receiver_m, ctx + q, plan, CapturedSource(captured), max_new_tokens=6).tokens


@pytest.mark.parametrize("transport", ["inproc", "nixl"])
def test_reuse_over_the_in_process_channel_equals_the_engine(tiny_pair, tiny_models, transport):
    """Sender, broker and receiver in one loop, bulk in process or over NIXL: the reply took the
    partial path, pulled bytes, and its tokens equal the engine's own partial prefill with the same group."""

    async def run() -> schemas.GenerateReply:
        async with mesh(tiny_pair, tiny_models, transport=transport) as (bus, *_):
            return await _prefill_and_ask(bus)

    reply = asyncio.run(run())
    assert (reply.path, reply.plan) == ("partial", "recompute [2,6)") and reply.bytes_pulled > 0, reply
    assert reply.token_ids == _engine_tokens(tiny_models, ReusePlan.recompute(2, 6))


@pytest.fixture
def xor_codec():
    codecs.register(XorCodec())
    XorCodec.decoded = 0
    yield XorCodec
    codecs.unregister("toy-xor")


def test_receiver_decodes_the_codec_its_pair_config_names(tiny_pair, tiny_models, xor_codec):
    """A pair config naming a registered codec makes the sender encode and the receiver decode
    every pulled tensor with it; the answer is unchanged."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)], codec="toy-xor"), 2, 0.99)
    cfg = _pair_config(tiny_pair, point)

    async def run() -> schemas.GenerateReply:
        async with mesh(tiny_pair, tiny_models, default_group=()) as (bus, board, _):
            await board.put(cfg)
            await bus.settle()
            return await _prefill_and_ask(bus)

    reply = asyncio.run(run())
    assert (reply.path, reply.plan) == ("partial", "recompute [2,4)"), reply
    assert xor_codec.decoded == 1 + 2 * 4  # E of layer 2, K and V of the 4 reused layers
    assert reply.token_ids == _engine_tokens(tiny_models, ReusePlan.recompute(2, 4))


class FrozenClient:
    """A bulk client whose pulls hang until released (a sender frozen mid-pull), then go on
    through the real channel. Records whether a pull was abandoned meanwhile."""

    def __init__(self, inner: BulkClient) -> None:
        self.inner, self.transport = inner, inner.transport
        self.release, self.entered, self.abandoned = asyncio.Event(), asyncio.Event(), False

    async def pull(self, address, request, into, on_item, timeout_s):  # the BulkClient.pull contract
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.abandoned = True
            raise
        return await self.inner.pull(address, request, into, on_item, timeout_s)

    async def warm(self, address: str) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        await self.inner.close()


def test_a_frozen_sender_does_not_hold_the_compute_thread(tiny_pair, tiny_models):
    """While one request waits on a frozen sender's pull, a concurrent full-prefill request on the
    same receiver is answered, and the frozen request is still waiting (not timed out), then
    completes on the partial path once the sender resumes."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, _, receiver):
            frozen = receiver.state.bulk = FrozenClient(receiver.state.bulk)
            await _ask(bus, subjects.sender_prefill("sender"),
                       schemas.PrefillRequest(request_id="p", context=CONTEXT), schemas.PrefillReply)
            await bus.settle()
            ask = functools.partial(_ask, bus, subjects.receiver_generate("receiver"), kind=schemas.GenerateReply)
            stalled = asyncio.create_task(ask(GenerateRequest(
                request_id="r1", context=CONTEXT, question=QUESTION, max_new_tokens=6)))
            await asyncio.wait_for(frozen.entered.wait(), 30)
            other = await asyncio.wait_for(ask(GenerateRequest(
                request_id="r2", context="other words entirely", question=QUESTION, max_new_tokens=6,
                mode="full_prefill")), 30)
            state_then = (stalled.done(), frozen.abandoned)
            frozen.release.set()
            return other, state_then, await stalled

    other, (stalled_done, abandoned), stalled = asyncio.run(run())
    assert other.path == "full_prefill"
    assert (stalled_done, abandoned) == (False, False)
    assert stalled.path == "partial" and stalled.token_ids == _engine_tokens(tiny_models, ReusePlan.recompute(2, 6))


def test_the_holdout_share_of_relayable_requests_is_served_by_full_prefill(tiny_pair, tiny_models):
    """With holdout_share 0.25, of 80 requests the policy would relay the control count is within
    4.5 standard deviations of 20 (binomial), each one a full prefill whose reason says "holdout";
    every other one is relayed, and the relay counter says so per outcome."""
    n, share = 80, 0.25

    async def run() -> tuple[list[schemas.GenerateReply], dict[str, float]]:
        async with mesh(tiny_pair, tiny_models, holdout_share=share) as (bus, _, receiver):
            await _prefill(bus)
            replies = [await _generate(bus, f"r{i}", max_new_tokens=1) for i in range(n)]
            registry = receiver.state.metrics.registry
            counts = {o: registry.get_sample_value("dm_relay_requests_total", {"bucket": "[0.95,1]", "outcome": o}) or 0
                      for o in ("relayed", "control", "own_prefill")}
            return replies, counts

    replies, counts = asyncio.run(run())
    control = [r for r in replies if r.path == "full_prefill"]
    assert counts == {"relayed": n - len(control), "control": len(control), "own_prefill": 0}  # the dashboard's counter
    sd = (n * share * (1 - share)) ** 0.5
    assert abs(len(control) - n * share) <= 4.5 * sd, len(control)
    assert all("holdout" in (r.fallback_reason or "") for r in control)
    assert all(r.path == "partial" for r in replies if r.path != "full_prefill")


def test_the_shadow_share_of_relayed_requests_is_answered_again_off_the_critical_path(tiny_pair, tiny_models):
    """With shadow_share 0.5, of 40 relayed greedy requests the number shadowed by a full prefill
    (once the receiver is idle) is within 4.5 standard deviations of 20; each logs an agreement in [0, 1]."""
    n, share = 40, 0.5

    async def run() -> tuple[list[schemas.GenerateReply], list[float]]:
        async with mesh(tiny_pair, tiny_models, shadow_share=share) as (bus, _, receiver):
            await _prefill(bus)
            replies = [await _generate(bus, f"r{i}", max_new_tokens=3) for i in range(n)]
            shadows = [t for t in asyncio.all_tasks() if t.get_name().startswith("shadow-")]
            await asyncio.gather(*shadows)
            return replies, list(receiver.state.shadow_agreements)

    replies, agreements = asyncio.run(run())
    assert all(r.path == "partial" for r in replies)
    assert abs(len(agreements) - n * share) <= 4.5 * (n * share * (1 - share)) ** 0.5, len(agreements)
    assert all(0.0 <= a <= 1.0 for a in agreements)


def test_a_relay_policy_published_to_the_board_reaches_a_running_receiver(tiny_pair, tiny_models):
    """The pair's config relays; the same config republished with the audit's veto over every
    reusable fraction (a new version) turns the next request into the receiver's own prefill,
    reason audit_policy, without a restart."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), 2, 0.99)
    cfg = _pair_config(tiny_pair, point)
    vetoed = msgspec.structs.replace(cfg, profile_version=2, relay=[schemas.RelayBucket(0.0, 1.0, False)])

    async def run() -> tuple[schemas.GenerateReply, schemas.GenerateReply]:
        async with mesh(tiny_pair, tiny_models, default_group=()) as (bus, board, _):
            await board.put(cfg)
            await bus.settle()
            before = await _prefill_and_ask(bus)
            await board.put(vetoed)
            await bus.settle()
            after = await _generate(bus, "r2")
            return before, after

    before, after = asyncio.run(run())
    assert (before.path, before.plan) == ("partial", "recompute [2,4)")
    assert after.path == "full_prefill" and "relay audit" in (after.fallback_reason or ""), after
    assert after.token_ids == _engine_tokens(tiny_models, ReusePlan.full_prefill())


def test_the_blind_share_is_relayed_where_the_policy_would_not_relay(tiny_pair, tiny_models):
    """The audit vetoes relaying at every reusable fraction; with blind_share 0.5 of 40 requests
    the relayed ones (the blind arm) are within 4.5 standard deviations of 20, the rest own prefill
    with reason audit_policy."""
    n, share = 40, 0.5
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), 2, 0.99)
    cfg = _pair_config(tiny_pair, point, relay=[schemas.RelayBucket(0.0, 1.0, False)])

    async def run() -> list[schemas.GenerateReply]:
        async with mesh(tiny_pair, tiny_models, default_group=(), blind_share=share) as (bus, board, _):
            await board.put(cfg)
            await _prefill(bus)
            return [await _generate(bus, f"r{i}", max_new_tokens=1) for i in range(n)]

    replies = asyncio.run(run())
    blind = [r for r in replies if r.path == "partial"]
    assert abs(len(blind) - n * share) <= 4.5 * (n * share * (1 - share)) ** 0.5, len(blind)
    assert all(r.plan == "recompute [2,4)" for r in blind)
    assert all(r.path == "full_prefill" and "relay audit" in (r.fallback_reason or "") for r in replies if r not in blind)


def test_a_quality_drop_holds_relaying_from_that_sender_until_a_newer_config(tiny_pair, tiny_models):
    """Full reuse disagrees with full prefill on these models: once the watch fires (window 2, from
    its first shadow below 0.99) later requests get their own prefill (quality_hold) although no
    profiler answers; a newer config for the pair lifts the hold."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[]), 0, 1.0)
    cfg = _pair_config(tiny_pair, point, task="multihop_qa", full_reuse_quality=1.0)
    newer = msgspec.structs.replace(cfg, profile_version=2, chosen=schemas.FrontierPoint(schemas.PlanSpec(groups=[(0, 6)]), 6, 1.0),
                                    frontier=[schemas.FrontierPoint(schemas.PlanSpec(groups=[(0, 6)]), 6, 1.0)])

    async def ask(bus, i: int) -> schemas.GenerateReply:
        reply = await _generate(bus, f"r{i}")
        await asyncio.gather(*[t for t in asyncio.all_tasks() if t.get_name().startswith("shadow-")])
        return reply

    async def run() -> tuple[list[schemas.GenerateReply], schemas.GenerateReply, bool]:
        async with mesh(tiny_pair, tiny_models, default_group=(), shadow_share=1.0, quality_threshold=0.99,
                        quality_window=2, reprofile_timeout_s=1.0) as (bus, board, receiver):
            await board.put(cfg)
            await _prefill(bus)
            replies = [await ask(bus, i) for i in range(4)]
            held = receiver.state.watch.held("sender")
            await board.put(newer)
            await bus.settle()
            return replies, await ask(bus, 9), held

    replies, after, held = asyncio.run(run())
    assert held and replies[0].plan == "full reuse"
    assert all(r.path == "full_prefill" and "quality_hold" in (r.fallback_reason or "") for r in replies[1:]), replies
    assert after.path == "partial" and after.plan == "recompute [0,6)"
