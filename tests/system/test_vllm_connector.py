"""vLLM as a DroidMesh receiver: a real nats-server (per-role users), a broker and a DroidMesh
sender of `real/base` as processes; `vllm serve` (vLLM's CPU build, in its own environment from
`infra/vllm/install.sh`, its OpenAI server started as the guide starts it: `client.serve_argv`)
serving `real/base` with the `docqa` adapter through the DroidMesh KV connector, asked over HTTP.
A `docqa` request over a context the sender holds reuses it under the pair's plan
(3 of 30 layers recomputed from the sender's E); a frozen sender's pull fails and vLLM prefills
the request itself, with vLLM's own answer. Loads here are vLLM's asynchronous ones (`async_load`:
the request waits while the others' steps go on); `test_vllm_sender.py` loads inside the step."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS, connect_as, mesh, publish_configs, start_sender
from droidmesh.shared.tools.bench import vllm_reuse
from tests.system.conftest import until_indexed, vllm_python

pytestmark = [pytest.mark.timeout(1200),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

HOSTILE = "hostile"  # the id of a sender of base serving garbage of the right layout
GARBLER = Path(__file__).with_name("garbage_sender.py")
PLAN = vllm_reuse.PLAN  # the tier's plan for base -> docqa: 3 of 30 layers from E_6
NEW_TOKENS = 12
READY_S = 600.0
CONTEXT = ("The Python Software Foundation is the organization behind Python. It holds the intellectual "
           "property rights behind Python, runs the Python Package Index and organizes PyCon US. ") * 6
QUESTION = "\nQuestion: Which index does the foundation run?\nAnswer:"


@dataclasses.dataclass
class Served:
    engine: ServedEngine
    sender: Any  # the DroidMesh sender's process
    ctx: list[int]  # the held context's ids
    q: list[int]
    hold: Callable[[list[str]], None]  # the sender prefills (and the broker indexes) more contexts
    access: Any  # the mesh's logins
    work: Path
    base: Path  # the sender's checkpoint (vLLM's base model)


@pytest.fixture(scope="module")
def served(real_tier: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python = vllm_python()
    base, docqa = ModelRef(real_tier / "base", "base"), ModelRef(real_tier / "docqa", "docqa")
    work = tmp_path_factory.mktemp("vllm")
    roster = Roster(senders=(("base", "base"), (HOSTILE, "base")), receivers=("docqa",))
    with mesh(roster) as (access, procs):
        asyncio.run(publish_configs([vllm_reuse.plan_config(real_tier, base, docqa)], access))
        procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **NO_HEALTH_PORT,
                                                                        **access.env_for("broker")}, log_dir=work))
        sender = start_sender(access, base, "base", PLAN.e_layers, work, {**THREADS, **NO_HEALTH_PORT},
                              paired=["docqa"], transport="shm",
                              heartbeat_s=30.0)  # a frozen sender stays indexed: its pull, not the lookup, fails
        procs.append(sender)
        password = work / "receiver.password"
        password.write_text(access.password(receiver_user("docqa")))
        connector = {"nats_url": access.url, "nats_user": receiver_user("docqa"), "nats_password_file": str(password),
                     "models": {"base": str(base.path), "docqa": str(docqa.path)}, "base_model": "base",
                     "transport": "shm", "reuse_timeout_s": 10.0, "async_load": True}
        engine = ServedEngine(python, {"model": str(base.path), "name": "base", "dtype": "float32",
                                            "loras": {"docqa": str(docqa.path)}, "connector": connector}, work,
                              free_port(), env={**THREADS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"})
        try:
            receiver = load_model(docqa.path, device="cpu", dtype="float32", name="docqa")
            ctx, q = text.prompt_ids(receiver.tokenizer, CONTEXT, QUESTION)

            def hold(contexts: list[str]) -> None:
                async def prefill() -> None:
                    (client,) = await connect_as(access, "admin")  # filling a sender is an operator's job
                    try:
                        for c in contexts:
                            await client.prefill("base", c, timeout=300.0)
                            await until_indexed(client, receiver, c)
                    finally:
                        await client.close()
                asyncio.run(prefill())

            hold([CONTEXT])
            engine.ready(READY_S)
            yield Served(engine, sender, ctx, q, hold, access, work, base.path)
        finally:
            engine.stop()


def test_a_docqa_request_reuses_bases_cache_under_the_plan(served, real_tier):
    """The connector's path is `partial` with the plan's group, every context token taken from the
    mesh; the answer agrees with DroidMesh's own engine under the same plan (float32: vLLM's and
    our kernels round differently, so the first token must agree and the greedy tokens in 10 of 12)."""
    engine, ctx, q = served.engine, served.ctx, served.q
    prompt = ctx + q
    got = engine.ask("reuse", prompt, max_tokens=NEW_TOKENS, lora="docqa")
    (decided,) = engine.events("request", got["request_id"])
    assert decided["path"] == "partial" and decided["plan"] == PLAN.label(), decided
    assert decided["reused_tokens"] == len(ctx), decided
    (loaded,) = engine.events("loaded", got["request_id"])
    assert loaded["bytes_pulled"] > 0 and loaded["layers"] == 30, loaded
    assert not engine.events("reuse_fallback", got["request_id"])

    sender = load_model(real_tier / "base", device="cpu", dtype="float32")
    receiver = load_model(real_tier / "docqa", device="cpu", dtype="float32")
    m = decided["reused_tokens"]
    src = CapturedSource(capture_prefill(sender, prompt[:m], e_layers=PLAN.e_layers))
    ours = generate(receiver, prompt, PLAN, src, max_new_tokens=NEW_TOKENS).tokens
    assert got["tokens"][0] == ours[0], (got["tokens"], ours)
    assert sum(a == b for a, b in zip(got["tokens"], ours, strict=True)) >= NEW_TOKENS - 2, (got["tokens"], ours)


def test_the_worker_loads_droidmeshs_weights_at_start(served):
    """`preload` (on by default): the worker loads its copy of the weights, the base and its adapter
    as one set, once vLLM has registered its caches, not inside the first request that reuses.
    The line may come after vLLM says it is ready: waited for, at most READY_S."""
    deadline = time.monotonic() + READY_S
    while not (lines := [line for line in list(served.engine.lines) if '"models_preloaded"' in line]):
        assert time.monotonic() < deadline, "no models_preloaded line from the worker"
        time.sleep(0.1)
    preloaded = json.loads(lines[0][lines[0].find("{"):])
    assert preloaded["models"] == ["base", "docqa"], preloaded
    assert not [line for line in list(served.engine.lines) if '"preload_failed"' in line]


def test_a_frozen_senders_pull_falls_back_to_vllms_own_prefill(served):
    """SIGSTOP the sender: the pull misses its deadline, the connector reports the request's blocks
    as failed loads and vLLM prefills them itself: the answer is vLLM's own (mode full_prefill)."""
    engine, sender, ctx, q = served.engine, served.sender, served.ctx, served.q
    prompt = ctx + q
    alone = engine.ask("alone", prompt, max_tokens=NEW_TOKENS, lora="docqa", mode="full_prefill")
    (decided,) = engine.events("request", alone["request_id"])
    assert decided["path"] == "full_prefill" and decided["reason"] == "forced", decided
    sender.popen.send_signal(signal.SIGSTOP)
    try:
        got = engine.ask("frozen", prompt, max_tokens=NEW_TOKENS, lora="docqa")
    finally:
        sender.popen.send_signal(signal.SIGCONT)
    (decided,) = engine.events("request", got["request_id"])
    assert decided["path"] == "partial", decided  # the holder was found and the plan chosen...
    (fallback,) = engine.events("reuse_fallback", got["request_id"])  # ...and its pull failed
    assert not engine.events("loaded", got["request_id"])
    assert got["tokens"] == alone["tokens"], (got["tokens"], alone["tokens"])


def test_the_vllm_benchs_measure_on_this_engine(served):
    """`droidmesh bench vllm`'s measurement on this module's engine (its mesh and engine start-up
    are this module's): the held context is served `partial` and `full_reuse` as asked, never
    a fallback, a context nobody holds by vLLM; every figure a positive number; the decode A/B's
    rounds run on it."""
    engine, ctx, q = served.engine, served.ctx, served.q
    fresh = list(reversed(ctx))  # shares no block with the held context: a miss
    rows = vllm_reuse.measure(engine, "connector", [len(ctx)], {len(ctx): (ctx, q)}, {len(ctx): (fresh, q)},
                              repeats=1, say=lambda line: None, adapter="docqa")
    row = rows[len(ctx)]
    assert row["paths"] == {"partial": ["partial"], "full_reuse": ["full_reuse"]}, row
    assert all(row[k] > 0 for k in ("full", "partial", "full_reuse")), row
    # the decode A/B's rounds on this engine (both sides the same one: the rates, not the ratio, asserted)
    ab = vllm_reuse.decode_ab(engine, engine, "ab", fresh + q, new_tokens=3, rounds=1, lora="docqa")
    assert ab["rounds"] == 1 and len(ab["rates"]["a"]) == len(ab["rates"]["b"]) == 1, ab
    assert ab["alone"] > 0 and ab["connector"] > 0 and ab["ratio_lo"] <= ab["ratio"] <= ab["ratio_hi"], ab


def test_the_vllm_rows_bench_asks_each_row_both_ways_on_this_engine(served, real_tier):
    """`droidmesh bench vllm-rows`' questions on this module's engine, a real doc_qa test row
    held by the sender: the same model is served `full_reuse` and answers with vLLM's own first
    token (same weights, float32: the cache is the one vLLM would compute, to rounding); docqa is
    served `partial` under the plan; every score a task score."""
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.bench import vllm_rows

    rows = make_rows("doc_qa", "test", 1, SuiteShape())
    served.hold([r["context"] for r in rows])
    spec = task_spec("doc_qa")
    tokenizer = load_model(real_tier / "base", device="cpu", dtype="float32").tokenizer
    same = vllm_rows.ask_same_model(served.engine, tokenizer, rows, spec)
    vllm_rows.ask_batched(served.engine, tokenizer, rows * 2, spec, same * 2, batch=2)  # the row twice at once
    pair = vllm_rows.ask_pair(served.engine, tokenizer, rows, spec, lora="docqa")
    assert [r["same_path"] for r in same] == ["full_reuse"] and [r["pair_path"] for r in pair] == ["partial"], (same, pair)
    assert all(r["first_token_equal"] for r in same), same
    assert all(0.0 <= r[k] <= 1.0 for r in pair for k in ("quality_alone", "quality_plan"))
    summary = vllm_rows.summarize(same, pair, None)
    assert summary["rows"] == {"same_model": 1, "pair": 1} and summary["same_model"]["greedy_agreement"] >= 0.0, summary
    own = summary["same_model"]["vllm_across_batch_sizes"]
    assert own["rows"] == 1 and 0.0 <= own["greedy_agreement"] <= 1.0, summary


async def _taken_by(request_id: str, *senders: Any, deadline_s: float = 60.0) -> Any:
    """The one of `senders` whose log says it served `request_id`."""
    async with asyncio.timeout(deadline_s):
        while True:
            for sender in senders:
                if any(e.get("request_id") == request_id for e in sender.events("request")):
                    return sender
            await asyncio.sleep(0.05)


def test_a_hostile_senders_garbage_falls_back_and_vllm_lives_on(served):
    """A second sender of base (its own id and NATS user) serves every layer's K/V as noise at the
    right scale and layout (`garbage_sender.py`): checksums and range checks pass it, the
    connector's KV screen does not. Nothing is written: vLLM prefills the request itself (the
    answer is vLLM's own), and the engine serves the next request from the honest sender."""
    from droidmesh.shared.mesh.nats_auth import sender_user

    engine, access = served.engine, served.access
    context = ("The json module encodes and decodes JSON. It maps Python dicts to JSON objects and lists "
               "to arrays, and reads files with load and strings with loads. ") * 6
    hostile = start_service(
        "sender", {"model_path": str(served.base), "model_id": "base", "sender_id": HOSTILE, "transport": "shm",
                   "e_layers": list(PLAN.e_layers), "heartbeat_s": 30.0}, access.url, name="sender-hostile",
        log_dir=served.work, env={**THREADS, **NO_HEALTH_PORT, **access.env_for(sender_user(HOSTILE))},
        wrap=[sys.executable, str(GARBLER), "random", "kv", "--"])
    base = load_model(served.base, device="cpu", dtype="float32")
    ctx, q = text.prompt_ids(base.tokenizer, context, QUESTION)
    try:
        hostile.wait_for(lambda line: '"reader_paired"' in line, 60, "the base-to-docqa pair config")

        async def hold() -> None:
            """Prefills of base go to either sender (one queue group): until the hostile one holds
            the context and the broker answers it (the newest holder of a prefix wins a tie). Which
            sender took each prefill is read off its own log by request id (a log line may trail the
            reply: waited for), so no later prefill can make the honest sender the newest holder."""
            (client,) = await connect_as(access, "admin")
            try:
                for _ in range(40):
                    rid = (await client.prefill("base", context, timeout=300.0)).request_id
                    if await _taken_by(rid, hostile, served.sender) is hostile:
                        break
                assert hostile.events("request"), "the hostile sender never got a prefill of base"
                for _ in range(2000):
                    found = (await client.lookup(ctx, base.fingerprint.id)).holder
                    if found is not None and found.sender_id == HOSTILE:
                        return
                raise AssertionError("the broker never answered the hostile holder")
            finally:
                await client.close()
        asyncio.run(hold())
        alone = engine.ask("hostile-alone", ctx + q, max_tokens=NEW_TOKENS, lora="docqa", mode="full_prefill")
        got = engine.ask("hostile", ctx + q, max_tokens=NEW_TOKENS, lora="docqa")
        (decided,) = engine.events("request", got["request_id"])
        assert decided["path"] == "partial", decided  # the hostile holder was found and the plan chosen...
        (fallback,) = engine.events("reuse_fallback", got["request_id"])  # ...and the screen refused its cache
        assert "screen" in fallback["reason"].lower(), fallback
        assert not engine.events("loaded", got["request_id"])
        assert got["tokens"] == alone["tokens"], (got["tokens"], alone["tokens"])
    finally:
        hostile.stop()
    assert engine.proc.poll() is None
    honest = engine.ask("after-hostile", served.ctx + served.q, max_tokens=2, lora="docqa")
    (decided,) = engine.events("request", honest["request_id"])
    assert decided["path"] == "partial" and engine.events("loaded", honest["request_id"]), decided
