"""The gateway as a process in front of a real mesh (nats-server, broker, sender, receiver), driven
by the official `openai` client and by curl."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, password_env, receiver_user
from droidmesh.shared.model import text
from droidmesh.shared.service.launch import NATS_AUTH_CONF, Proc, start_nats, start_service
from droidmesh.shared.tools.cli.ask import prefill as prefill_cmd
from droidmesh.shared.wire.generation import Sampling
from droidmesh.shared.wire.hashing import PUBLIC, caller_scope
from droidmesh.shared.wire.schemas import ChatMessage
from tests.system.conftest import until_indexed, words
from tests.unit.model.test_chat_prefix import SMOL_TEMPLATE

pytestmark = pytest.mark.system

THREADS = {"OMP_NUM_THREADS": "1"}
CONTEXT = words(400)
QUESTION = " what is gamma"
CHAT = [{"role": "user", "content": words(40, offset=3)}]


class Mesh:
    def __init__(self, url: str, gateway: Proc):
        self.url, self.gateway = url, gateway
        self.port = gateway.events("gateway_started")[0]["http_port"]
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.client = openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_pair(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The pair's checkpoints with SmolLM2-Instruct's chat template (and its default system turn), as
    a real instruct model's tokenizer carries one; the zoo's vocabulary has no room for its markers,
    so they are spelled in bytes (`chat_prefix_ids` holds either way)."""
    out = tmp_path_factory.mktemp("chat")
    for src in tiny_pair:
        shutil.copytree(src, out / src.name)
        tok = AutoTokenizer.from_pretrained(out / src.name)
        tok.chat_template = SMOL_TEMPLATE
        tok.save_pretrained(out / src.name)
    return out / tiny_pair[0].name, out / tiny_pair[1].name


@pytest.fixture(scope="module")
def mesh(chat_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One mesh for the module: nats, broker, sender `summ`, receiver `qa` (group [1, 2)), gateway on a
    free port; the models' tokenizers carry a chat template (`chat_pair`)."""
    nats, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")))
    procs: list[Proc] = [nats]
    try:
        procs.append(start_service("cache_broker", {}, url, env=THREADS))
        procs.append(start_service("sender", {"model_path": chat_pair[0], "model_id": "summ", "e_layers": [1]}, url, env=THREADS))
        procs.append(start_service("receiver", {"model_path": chat_pair[1], "model_id": "qa", "default_group": [1, 2]}, url,
                                   env=THREADS))
        procs.append(start_service("gateway", {"http_port": 0, "max_tokens_limit": 64, "default_max_tokens": 8}, url))
        yield Mesh(url, procs[-1])
    finally:
        for p in reversed(procs):
            p.stop()


def test_models_lists_the_receiver(mesh):
    """GET /v1/models through the openai client lists the receiver's model id."""
    assert "qa" in [m.id for m in mesh.client.models.list()]


def test_completion_and_chat(mesh):
    """A non-streamed completion and chat completion answer with usage and the droidmesh extension."""
    comp = mesh.client.completions.create(model="qa", prompt=words(60), max_tokens=6, temperature=0)
    assert comp.object == "text_completion" and comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage is not None and comp.usage.completion_tokens >= 1 and comp.usage.prompt_tokens > 0
    ext = (comp.model_extra or {})["droidmesh"]
    assert set(ext) == {"path", "plan", "ttft_ms", "bytes_pulled", "reused_tokens", "sender_id", "served_by", "fallback_reason"}
    chat = mesh.client.chat.completions.create(model="qa", messages=CHAT, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert (chat.model_extra or {})["droidmesh"]["served_by"]


def test_logprobs_and_n_through_the_openai_client(mesh, tiny_models):
    """`n` samples come back as choices; chat `logprobs` / `top_logprobs` and completions'
    `logprobs` come back in OpenAI's shapes, one
    entry per completion token, each the receiver model's log-probability (its own forward over
    the prompt and the answer, ATOL 1e-3 through JSON), the chosen token the likeliest (greedy)."""
    import torch

    chat = mesh.client.chat.completions.create(model="qa", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                               top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert chat.usage is not None and len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob for c in content)
    two = mesh.client.chat.completions.create(model="qa", messages=CHAT, max_tokens=5, temperature=0.9, seed=3, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage is not None
    assert two.usage.completion_tokens == sum(len(c.message.content.split()) for c in two.choices)  # one word a token
    comp = mesh.client.completions.create(model="qa", prompt=words(60), max_tokens=4, temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert comp.usage is not None and len(lp.tokens) == len(lp.token_logprobs) == comp.usage.completion_tokens
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text

    async def ask() -> tuple:
        client = await MeshClient.connect(mesh.url)
        try:
            return await client.ask("qa", words(60), "", max_new_tokens=4, mode="full_prefill",
                                    sampling=Sampling(logprobs=1))
        finally:
            await client.close()

    r = asyncio.run(ask())  # the same answer with its token ids: checked against the model's own forward
    # the gateway's request may have reused the receiver's own held prefill (exact, to rounding)
    assert [t.token for t in r.logprobs] == lp.tokens
    assert all(abs(t.logprob - x) < 1e-3 for t, x in zip(r.logprobs, lp.token_logprobs, strict=True))
    model = tiny_models[1]
    ctx, q = text.prompt_ids(model.tokenizer, words(60), "")
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([ctx + q + r.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # [T, vocab]
    for i, t in enumerate(r.logprobs):
        assert t.token_id == r.token_ids[i] and abs(float(ref[len(ctx + q) - 1 + i, t.token_id]) - t.logprob) < 1e-3


def test_streamed_chat_deltas_make_the_text(mesh):
    """A streamed chat's deltas concatenate to the text the same greedy request gets unstreamed; the
    finish chunk carries the extension and the last chunk the usage."""
    whole = mesh.client.chat.completions.create(model="qa", messages=CHAT, max_tokens=8, temperature=0)
    chunks = list(mesh.client.chat.completions.create(model="qa", messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and "droidmesh" in (finish[0].model_extra or {})
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_prompt_over_a_prefilled_context_reuses_the_senders_cache(mesh, tiny_models):
    """A completion whose prompt starts with a context the sender prefilled is served from the sender's KV."""
    async def prefill() -> None:
        client = await MeshClient.connect(mesh.url)
        try:
            await client.prefill("summ", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
        finally:
            await client.close()

    asyncio.run(prefill())
    comp = mesh.client.completions.create(model="qa", prompt=CONTEXT + QUESTION, max_tokens=4, temperature=0)
    ext = (comp.model_extra or {})["droidmesh"]
    assert ext["path"] != "full_prefill" and ext["bytes_pulled"] > 0 and ext["reused_tokens"] > 0, ext


def test_chat_over_a_document_prefilled_as_chat_reuses_it(mesh, chat_pair, tiny_models, tmp_path):
    """`droidmesh prefill --as-chat` caches a document as a chat's first user turn (after the
    template's default system turn); a chat through the gateway that opens with it, a question as
    the next turn, is served from that cache, the whole prefix reused."""
    doc = words(120, offset=5)
    (tmp_path / "doc.txt").write_text(doc)
    out = CliRunner().invoke(prefill_cmd, ["--sender", "summ", "--context", str(tmp_path / "doc.txt"), "--as-chat",
                                           "--nats", mesh.url])
    assert out.exit_code == 0, out.output
    prefix = text.chat_prefix_ids(AutoTokenizer.from_pretrained(chat_pair[1]), [ChatMessage("user", doc)])
    assert f"tokens: {len(prefix)}" in out.output

    _until_indexed(mesh, tiny_models[1], prefix)
    chat = mesh.client.chat.completions.create(model="qa", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": doc}, {"role": "user", "content": QUESTION}])
    ext = (chat.model_extra or {})["droidmesh"]
    assert ext["path"] != "full_prefill" and ext["bytes_pulled"] > 0 and ext["reused_tokens"] == len(prefix), ext


def test_a_fresh_chat_sharing_only_the_opening_reports_no_reuse(mesh, chat_pair, tiny_models):
    """The receiver holds the chats it prefilled; a fresh chat that shares only the template's
    opening (its default system turn) with a held one is a full prefill with cached_tokens 0,
    not a "full reuse" of the opening."""
    tok = AutoTokenizer.from_pretrained(chat_pair[1])
    held, fresh = ([ChatMessage("user", words(200, offset=k))] for k in (11, 29))
    mesh.client.chat.completions.create(model="qa", messages=[{"role": "user", "content": held[0].content}],
                                        max_tokens=2, temperature=0)
    ids, other = text.chat_prompt_ids(tok, fresh), text.chat_prompt_ids(tok, held)
    shared = next(i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b)
    assert 0 < shared < len(ids) // 2  # the precondition: a short common opening, under min_reuse_fraction

    # the broker answers the fresh prompt with the held chat's opening, in the scope the receiver
    # held it in: the gateway's own (this server has no users: the one anonymous caller's)
    _until_indexed(mesh, tiny_models[1], ids, scope=caller_scope(""))
    chat = mesh.client.chat.completions.create(model="qa", max_tokens=2, temperature=0,
                                               messages=[{"role": "user", "content": fresh[0].content}])
    ext = (chat.model_extra or {})["droidmesh"]
    assert (ext["path"], ext["reused_tokens"]) == ("full_prefill", 0), ext
    assert chat.usage is not None and chat.usage.prompt_tokens_details.cached_tokens == 0


def _until_indexed(mesh: Mesh, model, ids: list[int], scope: str = PUBLIC) -> None:
    async def indexed() -> None:
        client = await MeshClient.connect(mesh.url)
        try:
            await until_indexed(client, model, "", ids=ids, scope=scope)
        finally:
            await client.close()

    asyncio.run(indexed())


def test_errors_are_openai_errors(mesh):
    """An unknown model is NotFoundError, max_tokens above the limit BadRequestError, n=2 streamed
    BadRequestError (samples are answered whole)."""
    with pytest.raises(openai.NotFoundError):
        mesh.client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as e:
        mesh.client.completions.create(model="qa", prompt="x", max_tokens=65)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        mesh.client.chat.completions.create(model="qa", messages=CHAT, n=2, stream=True)
    assert e.value.body["param"] == "n"  # type: ignore[index]


def test_curl_and_the_canonical_log_line(mesh):
    """curl gets a chat completion; the gateway logs one `request` line per request with its id."""
    body = json.dumps({"model": "qa", "messages": CHAT, "max_tokens": 6, "temperature": 0})
    out = subprocess.run(["curl", "-sS", f"{mesh.base}/chat/completions", "-H", "Content-Type: application/json",
                          "-H", "x-request-id: curl-1", "-d", body], capture_output=True, text=True, check=True).stdout
    print(out)  # the README's example output (pytest -s)
    assert json.loads(out)["object"] == "chat.completion"
    mesh.gateway.wait_for(lambda line: '"curl-1"' in line and '"request"' in line, 30, "the request log line")
    (line,) = [r for r in mesh.gateway.events("request") if r["request_id"] == "curl-1"]
    assert line["status"] == 200 and line["route"] == "/v1/chat/completions" and "path" in line


def test_gateway_under_least_privilege(tiny_pair, services, tmp_path):
    """With the shipped NATS users the gateway discovers receivers and gets answers, streamed ones
    included (receiver-qa may publish chunks into the gateway's inbox)."""
    pw = {u: secrets.token_hex(12) for u in DEFAULT_ROSTER.users}
    nats, url = start_nats(store_dir=str(tmp_path / "js"), conf=NATS_AUTH_CONF,
                           env={password_env(u): p for u, p in pw.items()})
    services.append(nats)

    def role(name: str) -> dict[str, str]:
        return {**THREADS, "DM_NATS_USER": name, "DM_NATS_PASSWORD": pw[name]}

    services.append(start_service("profiler", {}, url, env=role("profiler")))  # creates the config bucket readers watch
    services.append(start_service("receiver", {"model_path": tiny_pair[1], "model_id": "qa"}, url,
                                  env=role(receiver_user("qa"))))
    gateway = start_service("gateway", {"http_port": 0}, url, env=role("gateway"))
    services.append(gateway)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.events('gateway_started')[0]['http_port']}/v1",
                           api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["qa"]
    chunks = list(client.chat.completions.create(model="qa", messages=CHAT, max_tokens=4, temperature=0, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not [line for line in nats.lines if "Permissions Violation" in line], nats.tail()
