"""The mesh wired in one process: in-process bus, real UCX, real engine."""

from __future__ import annotations

import asyncio
import contextlib

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
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest

CONTEXT = " ".join(["alpha beta gamma delta"] * 12)
QUESTION = " what is gamma"


@contextlib.asynccontextmanager
async def mesh(tiny_pair, tiny_models, default_group=(2, 6)):
    bus, board = InProcessBus(), InMemoryConfigBoard()
    sender_m, receiver_m = tiny_models
    scfg = SenderConfig(model_path=str(tiny_pair[0]), model_id="sender", e_layers=(0, 2), heartbeat_s=0.2)
    rcfg = ReceiverConfig(model_path=str(tiny_pair[1]), model_id="receiver", default_group=default_group)
    async with BrokerService(BrokerConfig(), bus=bus) as broker, \
            SenderService(scfg, bus=bus, model=sender_m, board=board) as sender, \
            ReceiverService(rcfg, bus=bus, model=receiver_m, board=board) as receiver:
        yield bus, broker, sender, receiver


async def _ask(bus, subject, msg, kind):
    data = await bus.request(subject, schemas.encode(msg), timeout=30)
    return schemas.decode(data, kind)


def test_partial_answer_equals_engine(tiny_pair, tiny_models):
    """Through the wired mesh the receiver's tokens equal the engine's in-process partial prefill."""
    sender_m, receiver_m = tiny_models

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, broker, sender, receiver):
            pre = await _ask(bus, subjects.sender_prefill("sender"),
                             schemas.PrefillRequest(request_id="p1", context=CONTEXT), schemas.PrefillReply)
            await bus.settle()
            assert len(broker.index) == 1 and pre.tokens > 16
            return await _ask(bus, subjects.receiver_generate("receiver"),
                              GenerateRequest(request_id="r1", context=CONTEXT, question=QUESTION,
                                              max_new_tokens=6), schemas.GenerateReply)

    reply = asyncio.run(run())
    assert reply.path == "partial", reply
    ctx, q = text.prompt_ids(receiver_m.tokenizer, CONTEXT, QUESTION)
    src = CapturedSource(capture_prefill(sender_m, ctx, e_layers=[2]))
    ref = generate(receiver_m, ctx + q, ReusePlan.recompute(2, 6), src, max_new_tokens=6,
                   eos_token_id=receiver_m.tokenizer.eos_token_id)
    assert reply.token_ids == ref.tokens
    assert reply.bytes_pulled > 0 and reply.sender_id is not None


def test_no_cache_means_full_prefill(tiny_pair, tiny_models):
    """Without any announced cache the receiver answers by full prefill and says why."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            return await _ask(bus, subjects.receiver_generate("receiver"),
                              GenerateRequest(request_id="r2", context=CONTEXT, question=QUESTION,
                                              max_new_tokens=4), schemas.GenerateReply)

    reply = asyncio.run(run())
    assert reply.path == "full_prefill" and reply.fallback_reason == "no cached prefix"


def test_bad_request_gets_error_reply(tiny_pair, tiny_models):
    """Malformed bytes and bad fields get specific error replies; the receiver keeps serving."""

    async def run():
        async with mesh(tiny_pair, tiny_models) as (bus, *_):
            subject = subjects.receiver_generate("receiver")
            garbage = schemas.decode(await bus.request(subject, b"\xc1\x00", 5), schemas.ErrorReply)
            bad_mode = await _ask(bus, subject, GenerateRequest(
                request_id="r3", context=CONTEXT, question=QUESTION, mode="warp"), schemas.ErrorReply)
            ok = await _ask(bus, subject, GenerateRequest(
                request_id="r4", context=CONTEXT, question=QUESTION, max_new_tokens=2), schemas.GenerateReply)
            return garbage, bad_mode, ok

    garbage, bad_mode, ok = asyncio.run(run())
    assert garbage.code == "bad_message"
    assert bad_mode.code == "bad_message" and "warp" in bad_mode.message  # Literal modes: refused at decode
    assert len(ok.token_ids) == 2
