"""Translated KV through the mesh : a receiver of another family (Qwen2, its own
tokenizer) answers over a context a Llama sender of the zoo's family tier holds, the sender's E
pulled over UCX and translated as it lands; and a translator whose hash is not the published one
costs only those requests: the receiver's own prefill, with the reason."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.kv import translate
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.kv.translate import TranslatedSource, align
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.zoo.manifest import read_manifest
from tests.system.conftest import until_indexed

pytestmark = pytest.mark.system

FAMILY = ZOO_DIR / "family"
SOURCE, TARGET = "small", "other"
THREADS = {"OMP_NUM_THREADS": "1"}
MAX_NEW = 4
ROW = make_rows("fact_lookup", "test", 1, SuiteShape())[0]


def _translator() -> tuple[str, str]:
    """(file, sha256) of the zoo's SOURCE -> TARGET translator, as its manifest publishes them."""
    (entry,) = [p for p in read_manifest(FAMILY)["translate_pairs"] if (p["source"], p["target"]) == (SOURCE, TARGET)]
    return str(FAMILY / entry["translator"]), entry["translator_sha256"]


def _start(services, url: str, translator: str) -> None:
    layers = read_manifest(FAMILY)["models"][SOURCE]["layers"]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    services.append(start_service("sender", {"model_path": FAMILY / SOURCE, "model_id": SOURCE,
                                             "e_layers": list(range(layers)), "transport": "ucx"}, url, env=THREADS))
    services.append(start_service("receiver", {"model_path": FAMILY / TARGET, "model_id": TARGET, "transport": "ucx",
                                               "translators": [translator]}, url, env=THREADS))


async def _prefill_and_ask(url: str, source):
    client = await MeshClient.connect(url)
    try:
        await client.prefill(SOURCE, ROW["context"])
        await until_indexed(client, source, ROW["context"])  # indexed in the source's own tokens
        return await client.ask(TARGET, ROW["context"], ROW["input"], max_new_tokens=MAX_NEW)
    finally:
        await client.close()


def test_receiver_of_another_family_answers_from_a_translated_context(nats, services):
    """Path `translate`, E bytes pulled, and the tokens the in-process engine gives over the same translation."""
    path, sha = _translator()
    _start(services, nats[1], f"{path}@{sha}")
    source, target = load_model(FAMILY / SOURCE, name=SOURCE), load_model(FAMILY / TARGET, name=TARGET)
    reply = asyncio.run(_prefill_and_ask(nats[1], source))
    assert reply.path == "translate", (reply.path, reply.fallback_reason)
    assert reply.plan == f"translated from {SOURCE}" and reply.bytes_pulled > 0 and reply.sender_id

    tr = translate.load(path, sha)
    s_ids, s_spans = text.context_spans(source.tokenizer, ROW["context"])
    t_ids, t_spans = text.context_spans(target.tokenizer, ROW["context"])
    translated = TranslatedSource(CapturedSource(capture_prefill(source, s_ids, tr.source_layers)), tr, target, t_ids,
                                  align(s_spans, t_spans), source.fingerprint)
    ref = generate(target, t_ids + text.question_ids(target.tokenizer, ROW["input"]), ReusePlan.full_reuse(), translated,
                   max_new_tokens=MAX_NEW, eos_token_id=target.tokenizer.eos_token_id)
    assert reply.token_ids == ref.tokens


def test_a_translator_with_another_hash_means_the_receivers_own_prefill_with_the_reason(nats, services):
    """A receiver named a translator under a wrong sha256 refuses it and answers by its own full prefill."""
    path, _ = _translator()
    _start(services, nats[1], f"{path}@{'0' * 64}")
    source, target = load_model(FAMILY / SOURCE, name=SOURCE), load_model(FAMILY / TARGET, name=TARGET)
    reply = asyncio.run(_prefill_and_ask(nats[1], source))
    assert reply.path == "fallback" and "translator_mismatch" in (reply.fallback_reason or ""), reply
    ctx, q = text.prompt_ids(target.tokenizer, ROW["context"], ROW["input"])
    own = generate(target, ctx + q, ReusePlan.full_prefill(), max_new_tokens=MAX_NEW,
                   eos_token_id=target.tokenizer.eos_token_id)
    assert reply.token_ids == own.tokens
