"""Translated KV between two real families through the mesh: SmolLM2-135M-Instruct (Llama
architecture, its own 49K-token tokenizer) holds a real doc_qa test-split context; Gemma 3 270M
(its own 262K-token tokenizer, sliding-window layers) answers over it on path `translate`, the
sender's E pulled and translated as it lands, in separate processes over a real nats-server.
The translator travels as `droidmesh profile --translate --publish` sends it: into the maps
bucket, from which the receiver fetches it by its sha256 alone. The answer's tokens equal the
in-process engine's under the same translator.

The translator is fit here, cheaply (a few short train-split contexts, the lowest source layer
only, full-rank maps, one ridge lambda): what is asserted is the mesh's equality with the engine,
not quality (docs/real-family.md has the quality). Skips, saying why, where the packages cannot be had. The
Gemma weights are under the Gemma Terms of Use: built into the user's cache, never committed."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats as nats_py
import pytest

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.kv.translate import TranslatedSource, align
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.maps_store import NatsMapsStore
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.profiling import translate_fit
from droidmesh.shared.tasks.realtext import make_real_rows
from tests.system.conftest import start_together, until_indexed

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

THREADS = {"OMP_NUM_THREADS": "1"}
SOURCE, TARGET = "smollm2", "gemma3"
MAX_NEW = 4
FIT_CHARS = (1200, 1800)  # train-split contexts of ~300-450 tokens: a cheap fit
ASK_CHARS = (1500, 2500)  # the asked test-split context: ~400-600 tokens
FIT_LAMBDAS = (0.1,)  # the ridge lambda the fit's default search picks for every target layer on these contexts


@pytest.fixture(scope="module")
def checkpoints() -> tuple[Path, Path]:
    """(SmolLM2 base, Gemma 3 270M base) checkpoint dirs, built (or reused) from their packages."""
    from droidmesh.shared.zoo import realbase
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    try:
        build_real(zoo_dir("real"))
    except DroidMeshError as e:
        pytest.skip(f"the real tier (SmolLM2-135M-Instruct) cannot be built here: {e}")
    try:
        gemma = realbase.gemma3_base()
    except DroidMeshError as e:
        pytest.skip(f"the Gemma 3 270M base cannot be built here: {e}")
    return zoo_dir("real") / "base", gemma


def _ask(url: str, source: ModelAdapter, row: dict) -> object:
    async def go():
        client = await MeshClient.connect(url)
        try:
            await client.prefill(SOURCE, row["context"], timeout=120)
            await until_indexed(client, source, row["context"])  # indexed in the source's own tokens
            return await client.ask(TARGET, row["context"], row["input"], max_new_tokens=MAX_NEW, timeout=120)
        finally:
            await client.close()

    return asyncio.run(go())


def _publish(url: str, data: bytes) -> str:
    """The translator into the maps bucket, as `profile --translate --publish` puts it; its sha256."""
    async def go() -> str:
        nc = await nats_py.connect(url)
        try:
            return await NatsMapsStore(nc).put(data)
        finally:
            await nc.close()

    return asyncio.run(go())


def test_gemma3_answers_from_a_smollm2_context_like_the_engine(checkpoints, tmp_path: Path, nats, services) -> None:
    s_path, t_path = checkpoints
    source, target = load_model(s_path, name=SOURCE), load_model(t_path, name=TARGET)
    train = [r["context"] for r in make_real_rows("doc_qa", "train", 3, chars=FIT_CHARS)]
    tr = translate_fit.fit(source, target, train, candidates=1, ranks=(), lambdas=FIT_LAMBDAS)
    sha = tr.save(tmp_path / "smollm2-gemma3.safetensors")
    row = make_real_rows("doc_qa", "test", 1, chars=ASK_CHARS)[0]  # test split: other source files than the fit's

    url = nats[1]
    assert _publish(url, (tmp_path / "smollm2-gemma3.safetensors").read_bytes()) == sha
    specs = [("cache_broker", {}, {"env": THREADS}),
             ("sender", {"model_path": s_path, "model_id": SOURCE, "e_layers": list(tr.source_layers), "heartbeat_s": 0.5},
              {"env": THREADS}),
             ("receiver", {"model_path": t_path, "model_id": TARGET,
                           "translators": [sha]}, {"env": THREADS})]
    with ThreadPoolExecutor(1) as pool:  # the services start while this process computes the engine's answer
        started = pool.submit(start_together, url, specs, services)
        s_ids, s_spans = text.context_spans(source.tokenizer, row["context"])
        t_ids, t_spans = text.context_spans(target.tokenizer, row["context"])
        translated = TranslatedSource(CapturedSource(capture_prefill(source, s_ids, tr.source_layers)), tr, target,
                                      t_ids, align(s_spans, t_spans), source.fingerprint)
        ref = generate(target, t_ids + text.question_ids(target.tokenizer, row["input"]), ReusePlan.full_reuse(),
                       translated, max_new_tokens=MAX_NEW, eos_token_id=target.tokenizer.eos_token_id)
        started.result()
    reply = _ask(url, source, row)
    assert reply.path == "translate", (reply.path, reply.fallback_reason)
    assert reply.plan == f"translated from {SOURCE}" and reply.bytes_pulled > 0

    assert len(t_ids) > 300 and len(s_ids) != len(t_ids)  # a real context, tokenized differently on each side
    assert reply.token_ids == ref.tokens
