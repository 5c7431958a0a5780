"""The gateway's OpenAI domain module: request parsing and limits, error mapping, response and SSE shapes."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp import web

from droidmesh.services.gateway import openai as oa
from droidmesh.services.gateway import responses
from droidmesh.shared.errors import DeadlineExceededError
from droidmesh.shared.mesh.client import MeshError
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateChunk, Sampling
from droidmesh.shared.wire.logprobs import TokenLogprob, TopLogprob

LIMITS = oa.Limits(default_max_tokens=16, max_tokens_limit=64)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def reply(text: str = "hello world", **kw) -> schemas.GenerateReply:
    base = dict(request_id="r", text=text, token_ids=[1, 2, 3], path="partial", fallback_reason=None, plan="recompute [1,2)",
                sender_id="s1", bytes_pulled=1000, ttft_ms=12.5, stages_ms={}, served_by="qa-1", prompt_tokens=10,
                reused_tokens=8, finish_reason="stop")
    return schemas.GenerateReply(**{**base, **kw})


def events(stream: bytes) -> list[str]:
    """The data payloads of an SSE byte stream (each frame `data: ...` then a blank line)."""
    assert stream.endswith(b"\n\n")
    frames = stream.decode().split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    return [f.removeprefix("data: ") for f in frames]


def test_completion_prompt_is_the_context():
    """A completion's prompt goes as the context with an empty question, OpenAI's sampling defaults and the default max_tokens."""
    call = oa.parse_completion(body(model="qa", prompt="some doc", stop="\n", seed=3), LIMITS)
    assert (call.kind, call.model, call.context, call.question, call.chat) == ("completion", "qa", "some doc", "", None)
    assert call.sampling == Sampling(temperature=1.0, top_p=1.0, seed=3, stop=["\n"])
    assert call.max_new_tokens == 16 and not call.stream and not call.include_usage


def test_chat_messages_become_chat_turns():
    """Chat messages map to ChatMessages (developer -> system, text parts joined); max_completion_tokens wins over max_tokens."""
    call = oa.parse_chat(body(model="qa", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
    ], max_tokens=5, max_completion_tokens=7, temperature=0, stream=True, stream_options={"include_usage": True}), LIMITS)
    assert call.chat == [schemas.ChatMessage("system", "be brief"), schemas.ChatMessage("user", "a b")]
    assert (call.context, call.question, call.max_new_tokens) == ("", "", 7)
    assert call.sampling.temperature == 0.0 and call.stream and call.include_usage


@pytest.mark.parametrize("fields,param", [
    (dict(max_tokens=65), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=""), "stop"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(model="m" * 300), "model"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    """A field of the wrong type, size or range is an invalid_request_error naming that field."""
    with pytest.raises(oa.InvalidRequestError) as e:
        oa.parse_completion(body(**{"model": "qa", "prompt": "p", **fields}), LIMITS)
    status, err = oa.to_http(e.value, "rid")
    assert status == 400 and err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields,param", [
    (dict(n=2, stream=True), "n"),
    (dict(logprobs=True, stream=True), "logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(made_up=1), "made_up"),
])
def test_unsupported_parameters_are_named(fields, param):
    """Parameters the mesh cannot honour (and unknown ones) are a 400 unsupported_parameter naming them."""
    with pytest.raises(oa.UnsupportedParameterError) as e:
        oa.parse_chat(body(model="qa", messages=[{"role": "user", "content": "hi"}], **fields), LIMITS)
    status, err = oa.to_http(e.value, "rid")
    assert (status, err["error"]["param"], err["error"]["code"]) == (400, param, "unsupported_parameter")


def test_neutral_values_of_unsupported_parameters_pass():
    """n=1, logprobs=false, tools=[] and the like ask for nothing the mesh lacks, so they are accepted."""
    call = oa.parse_chat(body(model="qa", messages=[{"role": "user", "content": "hi"}], n=1, logprobs=False, tools=[],
                              presence_penalty=0, response_format={"type": "text"}, user="u"), LIMITS)
    assert call.chat == [schemas.ChatMessage("user", "hi")]


@pytest.mark.parametrize("raw,code", [(b"{", "invalid_json"), (b"[1]", "invalid_value"), (b"", "invalid_json"),
                                      (b'{"model": "qa"}', "invalid_value")])
def test_malformed_bodies(raw, code):
    """Bodies that are not JSON, not an object, or miss a required field are 400s."""
    with pytest.raises(oa.InvalidRequestError) as e:
        oa.parse_completion(raw, LIMITS)
    assert oa.to_http(e.value, "rid")[1]["error"]["code"] == code


class NoRespondersError(Exception):
    """Stands in for nats.errors.NoRespondersError (matched by name)."""


def _no_responders() -> TimeoutError:
    try:
        raise TimeoutError("no reply") from NoRespondersError()
    except TimeoutError as e:
        return e


@pytest.mark.parametrize("exc,status,code", [
    (MeshError(schemas.ErrorReply(code="bad_request", message="empty prompt")), 400, "bad_request"),
    (MeshError(schemas.ErrorReply(code="deadline_exceeded", message="late")), 504, "deadline_exceeded"),
    (MeshError(schemas.ErrorReply(code="overloaded", message="receiver full")), 503, "overloaded"),
    (MeshError(schemas.ErrorReply(code="internal", message="Traceback secret")), 500, "internal"),
    (DeadlineExceededError("late"), 504, "deadline_exceeded"),
    (TimeoutError(), 504, "deadline_exceeded"),
    (_no_responders(), 503, "service_unavailable"),
    (oa.ModelNotFoundError("no such model", param="model"), 404, "model_not_found"),
    (oa.BodyTooLargeError("big"), 413, "request_too_large"),
    (oa.MeshUnavailableError("nats down"), 503, "service_unavailable"),
    (RuntimeError("boom"), 500, "internal"),
    (web.HTTPNotFound(), 404, "not_found"),
    (web.HTTPMethodNotAllowed("GET", ["POST"]), 405, "method_not_allowed"),
])
def test_errors_map_to_http_in_openai_shape(exc, status, code):
    """Every failure maps to one HTTP status and an OpenAI error body; a 500 never leaks its detail."""
    got, err = oa.to_http(exc, "rid-1")
    assert got == status and set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == code
    if status == 500:
        assert err["error"]["message"] == "internal error (request id rid-1)"


def test_completion_body_shapes():
    """Non-streamed answers carry OpenAI's fields, usage and the droidmesh extension."""
    comp = oa.parse_completion(body(model="qa", prompt="p"), LIMITS)
    out = responses.completion_body(comp, "abc", 7, reply())
    assert out["id"] == "cmpl-abc" and out["object"] == "text_completion" and out["created"] == 7
    assert out["choices"] == [{"index": 0, "text": "hello world", "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                            "prompt_tokens_details": {"cached_tokens": 8}}
    assert out["droidmesh"] == {"path": "partial", "plan": "recompute [1,2)", "ttft_ms": 12.5, "bytes_pulled": 1000,
                                "reused_tokens": 8, "sender_id": "s1", "served_by": "qa-1", "fallback_reason": None}
    chat = oa.parse_chat(body(model="qa", messages=[{"role": "user", "content": "q"}]), LIMITS)
    out = responses.completion_body(chat, "abc", 7, reply(finish_reason="length"))
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-abc"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    assert out["choices"][0]["finish_reason"] == "length"


def test_sse_framing():
    """An event is `data: <json>` and a blank line; the stream ends with `data: [DONE]`."""
    assert responses.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert responses.SSE_DONE == b"data: [DONE]\n\n"


def test_chat_stream_events():
    """Chunks carry deltas (the first with the role); the final reply adds what the chunks missed,
    the finish_reason chunk with the extension, the usage chunk, then [DONE]."""
    call = oa.parse_chat(body(model="qa", messages=[{"role": "user", "content": "q"}], stream=True,
                              stream_options={"include_usage": True}), LIMITS)
    enc = responses.SseEncoder(call, "abc", 7)
    raw = enc.chunk(GenerateChunk(request_id="r", index=0, text="hello", token_ids=[1]))
    raw += enc.chunk(GenerateChunk(request_id="r", index=1, text="", token_ids=[]))  # held back: no event
    raw += enc.final(reply(text="hello world"))
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-abc"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hello"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hello world"
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["droidmesh"]["path"] == "partial"
    assert finish["usage"] is None and all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                                       "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_stream_events_without_usage():
    """Completion chunks carry `text`; without include_usage no chunk has a usage field."""
    call = oa.parse_completion(body(model="qa", prompt="p", stream=True), LIMITS)
    enc = responses.SseEncoder(call, "abc", 7)
    raw = enc.chunk(GenerateChunk(request_id="r", index=0, text="hel", token_ids=[1])) + enc.final(reply(text="hello"))
    chunks = [msgspec.json.decode(d) for d in events(raw)[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["hel", "lo", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks) and chunks[0]["object"] == "text_completion"


def _lp(token_id: int, token: str, logprob: float, top: list[tuple[int, str, float]]) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, token=token, logprob=logprob,
                        top=[TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in top])


def test_logprobs_are_asked_of_the_mesh_and_returned_in_openai_shapes():
    """Chat's logprobs / top_logprobs and completions' logprobs become `Sampling.logprobs`; the
    reply's log-probabilities come back as each API's own shape."""
    msgs = [{"role": "user", "content": "q"}]
    assert oa.parse_chat(body(model="qa", messages=msgs), LIMITS).sampling.logprobs is None
    assert oa.parse_chat(body(model="qa", messages=msgs, logprobs=True), LIMITS).sampling.logprobs == 0
    chat = oa.parse_chat(body(model="qa", messages=msgs, logprobs=True, top_logprobs=2), LIMITS)
    assert chat.sampling.logprobs == 2
    comp = oa.parse_completion(body(model="qa", prompt="p", logprobs=2), LIMITS)
    assert comp.sampling.logprobs == 2
    r = reply(text="hello world", token_ids=[5, 6],
              logprobs=[_lp(5, "hello", -0.5, [(5, "hello", -0.5), (7, "hi", -1.5)]),
                        _lp(6, " world", -0.25, [(6, " world", -0.25), (8, " there", -2.0)])])
    content = responses.completion_body(chat, "a", 1, r)["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["hello", " world"] and content[1]["bytes"] == list(b" world")
    assert content[0]["logprob"] == -0.5 and [t["token"] for t in content[0]["top_logprobs"]] == ["hello", "hi"]
    legacy = responses.completion_body(comp, "a", 1, r)["choices"][0]["logprobs"]
    assert legacy == {"tokens": ["hello", " world"], "token_logprobs": [-0.5, -0.25],
                      "top_logprobs": [{"hello": -0.5, "hi": -1.5}, {" world": -0.25, " there": -2.0}],
                      "text_offset": [0, 5]}
    assert responses.completion_body(oa.parse_chat(body(model="qa", messages=msgs), LIMITS), "a", 1,
                                     reply())["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("fields,param", [
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=3), "logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(fields, param):
    with pytest.raises(oa.InvalidRequestError) as e:
        oa.parse_chat(body(model="qa", messages=[{"role": "user", "content": "q"}], **fields), LIMITS)
    assert oa.to_http(e.value, "rid")[1]["error"]["param"] == param


def test_n_samples_are_asked_of_the_mesh_and_each_is_a_choice():
    """n goes to the mesh; each sample of the reply is a choice (index in order), usage counts them all."""
    msgs = [{"role": "user", "content": "q"}]
    call = oa.parse_chat(body(model="qa", messages=msgs, n=3, temperature=0.7), LIMITS)
    assert call.n == 3 and oa.parse_chat(body(model="qa", messages=msgs), LIMITS).n == 1
    r = reply(text="a b", token_ids=[1, 2], finish_reason="length",
              samples=[schemas.SampleReply(text="c", token_ids=[3], finish_reason="stop"),
                       schemas.SampleReply(text="d e f", token_ids=[4, 5, 6], finish_reason="length")])
    out = responses.completion_body(call, "a", 1, r)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "a b", "length"), (1, "c", "stop"), (2, "d e f", "length")]
    assert out["usage"]["completion_tokens"] == 6
    with pytest.raises(oa.InvalidRequestError) as e:
        oa.parse_chat(body(model="qa", messages=msgs, n=oa.MAX_N + 1), LIMITS)
    assert oa.to_http(e.value, "rid")[1]["error"]["param"] == "n"
