"""Chat reuses a document prefilled as chat, and the gateway, `droidmesh ask` and `droidmesh
prefill` tokenize the same text the same way (`text.request_ids`), each through its own code: the
gateway's HTTP app, the CLI commands and the mesh client, down to the bytes on the bus and the
receiver's and sender's tokenization of them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.handlers import make_app
from droidmesh.services.gateway.state import GatewayState
from droidmesh.services.receiver.checks import prompt_ids
from droidmesh.services.sender.handlers import prefill_ids
from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.mesh import discovery
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.tools.cli import ask as ask_cli
from droidmesh.shared.tools.cli.connect import Conn
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.zoo.tokenizer import hf_tokenizer
from tests.unit.model.test_chat_prefix import smol_tokenizer
from tests.unit.services.test_gateway_openai import reply
from tests.unit.services.test_receiver_reuse import CONTEXT, QUESTION, mesh

SYSTEM = "Answer from the document."


class Recorder:
    """A bus that records what the mesh client sends and answers with canned replies."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        self.sent.append(data)
        if ".prefill" in subject:
            return schemas.encode(schemas.PrefillReply(request_id="p", context_id="c", tokens=99, nbytes=0))
        return schemas.encode(reply())


class Client(MeshClient):
    """The real mesh client, with one receiver model `qa` discovered (no NATS here)."""

    async def receivers(self, window_s: float = 0.5) -> list[discovery.ReceiverModel]:
        return [discovery.ReceiverModel("qa", ("qa-1",), "0")]


def gateway(client: MeshClient, path: str, body: dict[str, Any]) -> None:
    async def run() -> None:
        state = GatewayState(GatewayConfig(max_tokens_limit=64), client, Metrics("gateway"), mesh_up=lambda: True)
        async with TestClient(TestServer(make_app(state))) as c:
            r = await c.post(path, json={"model": "qa", "max_tokens": 4, "temperature": 0, **body})
            assert r.status == 200, await r.text()

    asyncio.run(run())


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[tuple[Recorder, Any]]:
    """(bus, invoke(command, args)): the CLI's commands over the recording bus, the document in a file."""
    bus = Recorder()
    monkeypatch.setattr(Conn, "run", lambda self, body, doing="": asyncio.run(body(None)))
    monkeypatch.setattr(ask_cli, "_client", lambda nc: MeshClient(bus))  # type: ignore[arg-type]
    doc = tmp_path / "doc.txt"
    doc.write_text(CONTEXT)

    def invoke(command: Any, *args: str) -> None:
        out = CliRunner().invoke(command, ["--context", str(doc), *args])
        assert out.exit_code == 0, out.output

    yield bus, invoke


def _generate(data: bytes) -> GenerateRequest:
    return schemas.decode(data, GenerateRequest)


@pytest.mark.parametrize("templated", [True, False], ids=["chat-template", "no-template"])
@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "own-system"])
def test_gateway_ask_and_prefill_tokenize_a_chat_alike(cli, templated, system):
    """The same conversation — a system message or the template's default one, the document as the
    first user turn, the question as the next — has the same ids through the gateway's chat
    endpoint and `ask --as-chat`; `prefill --as-chat` caches a prefix of them, so both reuse it."""
    bus, invoke = cli
    tok = smol_tokenizer() if templated else hf_tokenizer()
    messages = [*([{"role": "developer", "content": system}] if system else []),  # OpenAI's newer name for system
                {"role": "user", "content": CONTEXT}, {"role": "user", "content": QUESTION}]
    gateway(Client(bus), "/v1/chat/completions", {"messages": messages})
    own = ["--system", system] if system else []
    invoke(ask_cli.ask, "--question", QUESTION, "--receiver", "qa", "--as-chat", *own)
    invoke(ask_cli.prefill, "--sender", "s", "--as-chat", *own)
    via_gateway, via_ask = (prompt_ids(tok, _generate(d)) for d in bus.sent[:2])
    cached = prefill_ids(tok, schemas.decode(bus.sent[2], schemas.PrefillRequest))
    assert via_gateway == via_ask == text.chat_prompt_ids(tok, _generate(bus.sent[0]).chat or [])
    assert via_gateway[: len(cached)] == cached and len(via_gateway) > len(cached)
    if templated or not system:  # (without a template the plain rendering's prefix is the first message alone)
        assert len(cached) > len(text.question_ids(tok, CONTEXT))
    if templated:  # the template writes no start token and none is added
        assert tok.bos_token_id not in via_gateway and tok.bos_token_id not in cached


def test_gateway_ask_and_prefill_tokenize_a_document_alike(cli):
    """A document sent plainly: the gateway's completion of it, and `prefill` of it, have the same
    ids, one start token then the text; they are a prefix of `ask`'s request over it and of a
    completion of the document followed by a question."""
    bus, invoke = cli
    tok = smol_tokenizer()
    gateway(Client(bus), "/v1/completions", {"prompt": CONTEXT})
    gateway(Client(bus), "/v1/completions", {"prompt": CONTEXT + QUESTION})
    invoke(ask_cli.ask, "--question", QUESTION, "--receiver", "qa")
    invoke(ask_cli.prefill, "--sender", "s")
    completion, longer, asked = (prompt_ids(tok, _generate(d)) for d in bus.sent[:3])
    cached = prefill_ids(tok, schemas.decode(bus.sent[3], schemas.PrefillRequest))
    assert cached == completion == [tok.bos_token_id, *text.question_ids(tok, CONTEXT)]
    assert longer[: len(cached)] == cached and asked[: len(cached)] == cached and len(asked) > len(cached)


def test_system_needs_as_chat():
    """--system alone is a usage error (a plain context has no system turn), before any connecting."""
    out = CliRunner().invoke(ask_cli.prefill, ["--sender", "s", "--context", __file__, "--system", SYSTEM])
    assert out.exit_code == 2 and "--system needs --as-chat" in out.output


@pytest.mark.parametrize("req,match", [
    (schemas.PrefillRequest(request_id="p", context=""), "empty context"),
    (schemas.PrefillRequest(request_id="p", context="doc", chat=[schemas.ChatMessage("user", "doc")]), "context must be empty"),
    (schemas.PrefillRequest(request_id="p", context="", chat=[]), "1..64"),
])
def test_bad_prefill_requests(req, match):
    with pytest.raises(BadRequestError, match=match):
        prefill_ids(smol_tokenizer(), req)


def _templated(m: ModelAdapter) -> ModelAdapter:
    """`m` with SmolLM2's chat template on a copy of its tokenizer (the markers spelled in bytes: the
    tiny checkpoints' embeddings have no room for new tokens)."""
    tok = smol_tokenizer(special_markers=False)
    assert tok.get_vocab() == m.tokenizer.get_vocab()
    return ModelAdapter(model=m.model, tokenizer=tok, name=m.name)


def test_gateway_chat_reuses_a_document_prefilled_as_chat(tiny_pair, tiny_models):
    """In one process (broker, sender, receiver, gateway): a chat through the gateway whose first
    user message is a document the sender prefilled `--as-chat` is served from the sender's cache,
    its whole prefix reused; the document prefilled plainly was a prefix of no chat and reused
    nothing (what chats through the gateway got before)."""
    models = _templated(tiny_models[0]), _templated(tiny_models[1])
    chat = [schemas.ChatMessage("user", CONTEXT), schemas.ChatMessage("user", QUESTION)]
    body = {"messages": [{"role": m.role, "content": m.content} for m in chat], "model": "receiver",
            "max_tokens": 4, "temperature": 0}

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with mesh(tiny_pair, models) as (bus, *_):
            client = Client(bus)
            state = GatewayState(GatewayConfig(max_tokens_limit=64), client, Metrics("gateway"), mesh_up=lambda: True)
            client.receivers = _receiver  # type: ignore[method-assign]
            async with TestClient(TestServer(make_app(state))) as c:
                await client.prefill("sender", CONTEXT)
                await bus.settle()
                before = (await (await c.post("/v1/chat/completions", json=body)).json())["droidmesh"]
                await client.prefill("sender", "", chat=chat[:1])
                await bus.settle()
                after = (await (await c.post("/v1/chat/completions", json=body)).json())["droidmesh"]
                return before, after

    before, after = asyncio.run(run())
    assert before["reused_tokens"] == 0 and before["path"] in ("full_prefill", "fallback"), before
    prefix = text.chat_prefix_ids(models[1].tokenizer, chat[:1])
    assert after["path"] == "partial" and after["reused_tokens"] == len(prefix), after


async def _receiver(window_s: float = 0.5) -> list[discovery.ReceiverModel]:
    return [discovery.ReceiverModel("receiver", ("receiver-1",), "0")]
