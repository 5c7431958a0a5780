"""vLLM as a DroidMesh sender: a real nats-server (per-role users), a broker and a DroidMesh
receiver of `real/docqa` as processes, and `vllm serve real/base` (with the `docqa` LoRA adapter)
and the connector both loading and holding what it prefills (`hold`, role `kv_both`). A prompt
vLLM prefilled as `base` is announced under its holder id, then reused under the pair's plan by
the DroidMesh receiver and by vLLM's own `docqa` adapter: the layers outside the group are vLLM's
K/V, the group is recomputed from E_6, which the connector computed beside vLLM."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from droidmesh.shared.engines.vllm.client import ServedEngine
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.nats_auth import Roster, receiver_user
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import free_port, start_service
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS, connect_as, mesh, publish_configs
from droidmesh.shared.tools.bench import vllm_reuse
from droidmesh.shared.wire import schemas
from tests.system.conftest import until_indexed, vllm_python

pytestmark = [pytest.mark.timeout(1200),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

HOLDER = "vllm-base"  # the holder id vLLM's connector holds under (the roster's --holder base=vllm-base)
PLAN = vllm_reuse.PLAN  # the tier's plan for base -> docqa: 3 of 30 layers from E_6
NEW_TOKENS = 12
READY_S = 600.0
CONTEXT = ("The Rust Foundation supports the Rust language. It funds the maintainers of the compiler, "
           "runs the crates.io package registry and hosts RustConf each year. ") * 6
QUESTION = "\nQuestion: Which registry does the foundation run?\nAnswer:"


def test_the_cache_layout_reads_back_what_vllms_write_op_wrote():
    """`pages.read_slots` against vLLM's own cache-write op, in vLLM's environment: random K/V
    written at shuffled blocks (a partial last one) come back bit for bit, for every layout this
    CPU's attention picks (fp32 and bf16; block sizes 16, 32, 128). The backends the connector
    knows by name are vLLM's own (its registry's classes answer those names)."""
    python = vllm_python()
    script = """
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from droidmesh.shared.engines.vllm import pages
for dt in (torch.float32, torch.bfloat16):
    for bs, d in ((16, 64), (32, 64), (128, 64)):
        isa, h, nb, t = _get_attn_isa(dt, bs, d, "auto"), 3, 7, 2 * bs + 5
        slots = pages.slots_of(torch.randperm(nb)[: (t + bs - 1) // bs].tolist(), bs, t)
        k, v = torch.randn(1, h, t, d).to(dt), torch.randn(1, h, t, d).to(dt)
        cache = torch.full((nb, h, bs, 2 * d), float("nan"), dtype=dt)
        pages.write_layer(cache, k, v, slots, isa)
        got_k, got_v = pages.read_slots(cache, slots, isa)
        print(isa, torch.equal(got_k, k) and torch.equal(got_v, v))
from vllm.v1.attention.backends.registry import AttentionBackendEnum
names = [pages.CPU_BACKEND, *sorted(pages.FLASH_BACKENDS)]
print("names", all(AttentionBackendEnum[n].get_class().get_name() == n for n in names))
"""
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    results = [line.split() for line in lines if line.strip() and not line.startswith("Triton")]
    assert len(results) == 7 and all(ok == "True" for _, ok in results), out.stdout


@pytest.fixture(scope="module")
def sending(real_tier: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedEngine, object]]:
    """The mesh (broker, DroidMesh receiver of docqa) and vLLM serving base, holding its prefills."""
    python = vllm_python()
    base, docqa = ModelRef(real_tier / "base", "base"), ModelRef(real_tier / "docqa", "docqa")
    work = tmp_path_factory.mktemp("vllm-sender")
    roster = Roster(senders=(), receivers=("base", "docqa"), holders=(("base", HOLDER),))
    with mesh(roster) as (access, procs):
        asyncio.run(publish_configs([vllm_reuse.plan_config(real_tier, base, docqa)], access))
        env = {**THREADS, **NO_HEALTH_PORT}
        procs.append(start_service("cache_broker", {}, access.url, env={**env, **access.env_for("broker")}, log_dir=work))
        procs.append(start_service("receiver", {"model_path": str(docqa.path), "model_id": "docqa", "transport": "shm",
                                                "hold": False}, access.url, name="receiver-docqa", log_dir=work,
                                   env={**env, **access.env_for(receiver_user("docqa"))}))
        password = work / "base.password"
        password.write_text(access.password(receiver_user("base")))
        connector = {"nats_url": access.url, "nats_user": receiver_user("base"), "nats_password_file": str(password),
                     "models": {"base": str(base.path), "docqa": str(docqa.path)}, "base_model": "base",
                     "transport": "shm", "reuse_timeout_s": 30.0,
                     "hold": True, "holder_id": HOLDER, "hold_e_layers": list(PLAN.e_layers), "readers": ["docqa"]}
        engine = ServedEngine(python, {"model": str(base.path), "name": "base", "dtype": "float32",
                                       "loras": {"docqa": str(docqa.path)}, "connector": connector}, work, free_port(),
                              env={**THREADS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"})
        try:
            engine.ready(READY_S)
            yield engine, access
        finally:
            engine.stop()


@pytest.fixture(scope="module")
def held(sending, real_tier: Path) -> tuple[list[int], list[int]]:
    """(context ids, question ids): vLLM answers over the context as `base` (its own prefill,
    logged `saved`), and its holder has held it (`held`, once E is computed)."""
    engine, _ = sending
    tok = load_model(real_tier / "docqa", device="cpu", dtype="float32").tokenizer
    ctx, q = text.prompt_ids(tok, CONTEXT, QUESTION)
    first = engine.ask("prefill", ctx, max_tokens=1)
    (decided,) = engine.events("request", first["request_id"])
    assert decided["path"] == "full_prefill", decided  # nothing held it before
    assert engine.events("saved", first["request_id"]), "vLLM's connector did not hand its prefill to the holder"
    # the holder computes E (loading DroidMesh's copy of the weights the first time) before it announces
    engine.wait(lambda: any('"event": "held"' in line for line in engine.lines), 300, "the holder's `held` line")
    return ctx, q


def _ours(real_tier: Path, ctx: list[int], q: list[int]) -> list[int]:
    """DroidMesh's engine under the plan, over a DroidMesh capture of the context by base."""
    base = load_model(real_tier / "base", device="cpu", dtype="float32")
    receiver = load_model(real_tier / "docqa", device="cpu", dtype="float32", name="docqa")
    src = CapturedSource(capture_prefill(base, ctx, e_layers=PLAN.e_layers))
    return generate(receiver, ctx + q, PLAN, src, max_new_tokens=NEW_TOKENS).tokens


def _agrees(got: list[int], ours: list[int]) -> bool:
    """float32 through two kernels: the first token equal, the greedy tokens in 10 of 12."""
    return got[0] == ours[0] and sum(a == b for a, b in zip(got, ours, strict=True)) >= NEW_TOKENS - 2


def test_a_prompt_vllm_prefilled_is_pulled_by_a_droidmesh_receiver_under_the_plan(sending, held, real_tier):
    """The broker answers vLLM's holder id; the docqa receiver's request over context + question
    is `partial` from that holder, every context token reused, and answers as DroidMesh's engine
    does under the plan over a DroidMesh capture of the same context."""
    engine, access = sending
    ctx, q = held
    receiver = load_model(real_tier / "docqa", device="cpu", dtype="float32", name="docqa")

    async def ask() -> schemas.GenerateReply:
        (client,) = await connect_as(access, "admin")
        try:
            await until_indexed(client, receiver, CONTEXT)
            return await client.ask("docqa", CONTEXT, QUESTION, max_new_tokens=NEW_TOKENS, timeout=300)
        finally:
            await client.close()

    reply = asyncio.run(ask())
    assert (reply.path, reply.sender_id, reply.plan) == ("partial", HOLDER, PLAN.label()), reply
    assert reply.reused_tokens == len(ctx) and reply.bytes_pulled > 0, reply
    ours = _ours(real_tier, ctx, q)
    assert _agrees(reply.token_ids, ours), (reply.token_ids, ours)


def test_what_the_base_prefilled_is_reused_by_vllms_own_adapter(sending, held, real_tier):
    """Across what vLLM keeps apart (its prefix cache is per adapter): a `docqa` request over the
    context `base` prefilled is `partial` under the pair's plan, loaded from vLLM's own holder,
    and answers as DroidMesh's engine does under the plan."""
    engine, _ = sending
    ctx, q = held
    got = engine.ask("adapter", ctx + q, max_tokens=NEW_TOKENS, lora="docqa")
    (decided,) = engine.events("request", got["request_id"])
    assert (decided["path"], decided["plan"], decided["reused_tokens"]) == ("partial", PLAN.label(), len(ctx)), decided
    (loaded,) = engine.events("loaded", got["request_id"])
    assert loaded["bytes_pulled"] > 0, loaded
    ours = _ours(real_tier, ctx, q)
    assert _agrees(got["tokens"], ours), (got["tokens"], ours)
