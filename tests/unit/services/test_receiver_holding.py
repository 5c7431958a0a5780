"""A receiver holds what its own prefills computed: the broker returns it as a holder, the next
request over the same text reuses it (in process for the same receiver, pulled by another one),
with no prefill command. In-process bus, broker and bulk channel; the real engine on tiny checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.service import ReceiverService
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.config_board import InMemoryConfigBoard
from droidmesh.shared.model import text
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.hashing import PUBLIC, caller_scope, tenant_scope

CONTEXT = " ".join(["alpha beta gamma delta"] * 12)
QUESTION = " what is gamma"


def _receiver(path, model_id: str, **kw) -> ReceiverConfig:
    return ReceiverConfig(model_path=str(path), model_id=model_id, transport="inproc", heartbeat_s=0.2, **kw)


async def _ask(bus, model_id: str, request_id: str, mode: schemas.Mode = "auto", scope: str = PUBLIC,
               context: str = CONTEXT) -> schemas.GenerateReply:
    req = GenerateRequest(request_id=request_id, context=context, question=QUESTION, max_new_tokens=6, mode=mode,
                          scope=scope)
    return schemas.decode(await bus.request(subjects.receiver_generate(model_id), schemas.encode(req), timeout=30),
                          schemas.GenerateReply)


async def _held(service: ReceiverService, n: int = 1) -> None:
    """Until the receiver holds `n` contexts (the hold runs after the answer), then the bus settles."""
    holder = service.state.holder
    deadline = time.monotonic() + 30
    while len(holder.store.ids()) < n:
        assert time.monotonic() < deadline, "the served prefill was never held"
        await asyncio.sleep(0.01)
    await service.state.bus.settle()


@contextlib.asynccontextmanager
async def _mesh(*receivers):
    bus, board = InProcessBus(), InMemoryConfigBoard()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(BrokerService(BrokerConfig(), bus=bus))
        yield bus, [await stack.enter_async_context(ReceiverService(cfg, bus=bus, model=m, board=board))
                    for cfg, m in receivers]


def _prompt(model) -> list[int]:
    ctx, q = text.prompt_ids(model.tokenizer, CONTEXT, QUESTION)
    return ctx + q


def test_a_served_prefill_becomes_a_holder_the_broker_returns_and_the_repeat_reuses_it(tiny_pair, tiny_models):
    """No sender, no prefill command: the first request is a full prefill, held before its reply;
    the repeat, sent the moment that reply arrives, reuses it in process (full reuse of its own KV,
    nothing pulled; its tokens equal the first answer's); the broker returns the receiver itself
    as the holder of the whole prompt, in the asker's own scope (a request naming no scope is its
    caller's: here an anonymous one), and to a public lookup nothing."""
    model = tiny_models[1]
    prompt = _prompt(model)

    async def run():
        async with _mesh((_receiver(tiny_pair[1], "receiver"), model)) as (bus, [svc]):
            first = await _ask(bus, "receiver", "r1")
            second = await _ask(bus, "receiver", "r2")  # at once: held before the first reply went out
            await _held(svc)
            found, public = [schemas.decode(await bus.request(subjects.BROKER_LOOKUP, schemas.encode(
                schemas.LookupRequest(token_ids=prompt, fingerprint_id=model.fingerprint.id, scope=scope)), timeout=5),
                schemas.LookupReply) for scope in (caller_scope(""), PUBLIC)]
            return first, found, public, second, svc.state.holder.id

    first, found, public, second, holder_id = asyncio.run(run())
    assert public.holder is None
    assert first.path == "full_prefill" and first.reused_tokens == 0
    assert found.holder is not None and found.holder.sender_id == holder_id and found.holder.model_id == "receiver"
    assert found.holder.token_ids == prompt and found.matched_tokens == len(prompt)
    assert second.path == "full_reuse" and second.reused_tokens == len(prompt) - 1 and second.bytes_pulled == 0
    assert second.token_ids == first.token_ids


def test_what_a_tenant_prefilled_is_held_in_its_scope_only(tiny_pair, tiny_models):
    """Tenant a's served prefill is held in a's scope: tenant b's identical request is its own full
    prefill (and held apart), a's repeat reuses a's."""
    a, b = tenant_scope("a", b"s"), tenant_scope("b", b"s")

    async def run():
        async with _mesh((_receiver(tiny_pair[1], "receiver"), tiny_models[1])) as (bus, [svc]):
            await _ask(bus, "receiver", "a1", scope=a)
            await _held(svc)
            other = await _ask(bus, "receiver", "b1", scope=b)
            await _held(svc, 2)
            again = await _ask(bus, "receiver", "a2", scope=a)
            return other, again, sorted(c.scope for _, c in svc.state.holder.store.items())

    other, again, scopes = asyncio.run(run())
    assert other.path == "full_prefill" and other.reused_tokens == 0
    assert again.path == "full_reuse" and again.reused_tokens > 0
    assert scopes == sorted([a, b])


def test_a_prompt_sharing_only_a_held_opening_is_prefilled_and_held_whole(tiny_pair, tiny_models):
    """A second document that shares only its opening (under min_reuse_fraction) with a held one is
    a full prefill reporting no reuse, not a "full reuse" of the opening; it is then held whole:
    its repeat reuses all of it."""
    other = " ".join(CONTEXT.split()[:8] + ["epsilon zeta eta theta"] * 10)

    async def run():
        async with _mesh((_receiver(tiny_pair[1], "receiver"), tiny_models[1])) as (bus, [svc]):
            await _ask(bus, "receiver", "r1")
            second = await _ask(bus, "receiver", "r2", context=other)
            third = await _ask(bus, "receiver", "r3", context=other)
            return second, third, len(svc.state.holder.store.ids())

    second, third, held = asyncio.run(run())
    assert second.path == "full_prefill" and second.reused_tokens == 0
    assert held == 2 and third.path == "full_reuse" and third.reused_tokens == third.prompt_tokens - 1
    assert third.token_ids == second.token_ids


def test_an_explicit_mode_does_not_answer_from_what_the_receiver_holds_itself(tiny_pair, tiny_models):
    """`mode` full_reuse asks to reuse another holder's cache: the receiver's own held prefill is
    not it (it would be its own KV), so with no other holder the request is its own prefill."""
    async def run():
        async with _mesh((_receiver(tiny_pair[1], "receiver"), tiny_models[1])) as (bus, [svc]):
            await _ask(bus, "receiver", "r1")
            await _held(svc)
            return await _ask(bus, "receiver", "r2", mode="full_reuse")

    reply = asyncio.run(run())
    assert reply.reused_tokens == 0 and reply.path in ("fallback", "full_prefill"), reply


def test_another_models_receiver_pulls_what_a_receiver_holds(tiny_pair, tiny_models):
    """The receiver of the sender's weights serves a request and holds it (E of layer 2 kept); a
    receiver of the other model, recomputing [2, 6) by default, then pulls that context over the
    bulk channel: its tokens equal the engine's over a capture of the same prompt by the first model."""
    sender_m, receiver_m = tiny_models
    prompt = _prompt(receiver_m)

    async def run():
        async with _mesh((_receiver(tiny_pair[0], "sender", hold_e_layers=(2,)), sender_m),
                         (_receiver(tiny_pair[1], "receiver", default_group=(2, 6), hold=False), receiver_m)
                         ) as (bus, [holding, _]):
            await _ask(bus, "sender", "s1")
            await _held(holding)
            return await _ask(bus, "receiver", "r1")

    reply = asyncio.run(run())
    assert reply.path == "partial" and reply.reused_tokens == len(prompt) - 1 and reply.bytes_pulled > 0
    captured = capture_prefill(sender_m, prompt, [2])
    assert reply.token_ids == generate(receiver_m, prompt, ReusePlan.recompute(2, 6), CapturedSource(captured),
                                       max_new_tokens=6).tokens


def _lora(base, out, seed: int, targets: list[str]):
    """A random LoRA of `base` (lora_B non-zero, so it changes the outputs), saved as peft does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), cfg).save_pretrained(str(out))
    return out


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_adapters_in_one_receiver_reuse_each_others_kv_in_process(tiny_pair, tmp_path):
    """One receiver serves a base and two LoRAs of it from one copy of the weights: a request to
    adapter `a` is held; the same prompt to adapter `b` (recomputing [2, 6) by default) reuses it in
    process, nothing pulled, and its tokens equal the engine's with that plan over a capture by `a`."""
    from droidmesh.shared.model.lora import AdapterSet

    base = tiny_pair[1]
    a = _lora(base, tmp_path / "a", 1, ["q_proj", "v_proj"])
    b = _lora(base, tmp_path / "b", 2, ["k_proj", "o_proj", "down_proj"])
    cfg = _receiver(base, "base", adapters=(f"a={a}", f"b={b}"), default_group=(2, 6), hold_e_layers=(2,))

    async def run():
        async with _mesh((cfg, None)) as (bus, [svc]):
            first = await _ask(bus, "a", "a1")
            await _held(svc)
            return first, await _ask(bus, "b", "b1"), sorted(svc.states)

    first, reply, served = asyncio.run(run())
    assert served == ["a", "b", "base"]
    views = AdapterSet.load(base, {"a": a, "b": b}, base_name="base").views()
    prompt = _prompt(views["b"])
    assert first.path == "full_prefill" and first.token_ids == generate(views["a"], prompt, ReusePlan.full_prefill(),
                                                                        max_new_tokens=6).tokens
    assert reply.path == "partial" and reply.reused_tokens == len(prompt) - 1 and reply.bytes_pulled == 0
    captured = capture_prefill(views["a"], prompt, [2])
    assert reply.token_ids == generate(views["b"], prompt, ReusePlan.recompute(2, 6), CapturedSource(captured),
                                       max_new_tokens=6).tokens
