"""OpenAI's response shapes from the mesh's replies: pure functions, no I/O.

Called by the gateway's handlers on its event loop with a `GenerateReply` (or its streamed
`GenerateChunk`s) a receiver sent and the `MeshCall` the request was parsed into: the whole
answer's body, the server-sent events of a streamed one, the models list, and what the request
log records. A reply is trusted as the bus decoded it (every field's type checked).
"""

from __future__ import annotations

from typing import Any

import msgspec

from droidmesh.services.gateway.openai import MeshCall
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateChunk
from droidmesh.shared.wire.logprobs import TokenLogprob


def extension(r: schemas.GenerateReply) -> dict[str, Any]:
    """The `droidmesh` field: how the mesh served this answer."""
    return {"path": r.path, "plan": r.plan, "ttft_ms": round(r.ttft_ms, 2), "bytes_pulled": r.bytes_pulled,
            "reused_tokens": r.reused_tokens, "sender_id": r.sender_id, "served_by": r.served_by,
            "fallback_reason": r.fallback_reason}


def usage(r: schemas.GenerateReply) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens` are the prompt tokens whose KV was reused, which the mesh
    only finds within the request's scope (the tenant's own contexts and public ones)."""
    completion = completion_tokens(r)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.reused_tokens}}


def completion_tokens(r: schemas.GenerateReply) -> int:
    """Tokens decoded for the answer, every sample's."""
    return len(r.token_ids) + sum(len(x.token_ids) for x in r.samples)


def response_id(call: MeshCall, request_id: str) -> str:
    return ("chatcmpl-" if call.kind == "chat" else "cmpl-") + request_id


def completion_body(call: MeshCall, rid: str, created: int, r: schemas.GenerateReply) -> dict[str, Any]:
    """The whole (non-streamed) answer: a choice per sample."""
    samples = [(r.text, r.finish_reason, r.logprobs), *((x.text, x.finish_reason, x.logprobs) for x in r.samples)]
    choices = []
    for i, (text, finish, logprobs) in enumerate(samples):
        content = {"message": {"role": "assistant", "content": text}} if call.kind == "chat" else {"text": text}
        choices.append({"index": i, **content, "logprobs": logprobs_body(call, logprobs), "finish_reason": finish})
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return {"id": response_id(call, rid), "object": obj, "created": created, "model": call.model,
            "choices": choices, "usage": usage(r), "droidmesh": extension(r)}


def logprobs_body(call: MeshCall, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice: chat's `content` list, or completions' parallel lists
    (`text_offset` counted from the start of the answer: the prompt is not echoed)."""
    if logprobs is None:
        return None
    if call.kind == "chat":
        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(a.token, a.logprob) for a in t.top]}
                            for t in logprobs], "refusal": None}
    offsets, at = [], 0
    for t in logprobs:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in logprobs]
            if call.sampling.logprobs else None, "text_offset": offsets}


def models_body(models: list[tuple[str, int, int]]) -> dict[str, Any]:
    """GET /v1/models from (model id, first seen unix time, live instances)."""
    return {"object": "list", "data": [model_entry(*m) for m in models]}


def model_entry(model_id: str, created: int, instances: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "droidmesh",
            "droidmesh": {"instances": instances}}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SseEncoder:
    """One streamed request's events: a chunk per mesh chunk, then from the final reply any text
    the chunks missed, the chunk with `finish_reason` (and the `droidmesh` field), the usage
    chunk when asked for, and `[DONE]`."""

    def __init__(self, call: MeshCall, rid: str, created: int):
        self.call, self.created = call, created
        self.id = response_id(call, rid)
        self.sent: list[str] = []
        self.reply: schemas.GenerateReply | None = None

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.call.model, "choices": [choice], **extra}
        if self.call.include_usage:
            body.setdefault("usage", None)  # as OpenAI: every chunk but the last has usage null
        return body

    def _delta(self, text: str, finish: str | None = None) -> bytes:
        if self.call.kind == "chat":
            delta: dict[str, str] = {"content": text} if text or finish is None else {}
            if not self.sent and finish is None:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is None:
            self.sent.append(text)
            return sse(self._chunk(choice))
        assert self.reply is not None
        return sse(self._chunk(choice, droidmesh=extension(self.reply)))

    def chunk(self, c: GenerateChunk) -> bytes:
        return self._delta(c.text) if c.text else b""

    def final(self, r: schemas.GenerateReply) -> bytes:
        self.reply = r
        so_far = "".join(self.sent)
        # The reply carries the whole text: a chunk the stream lost is completed from it.
        out = self._delta(r.text[len(so_far):]) if r.text.startswith(so_far) and len(r.text) > len(so_far) else b""
        out += self._delta("", finish=r.finish_reason)
        if self.call.include_usage:
            body = self._chunk({}, usage=usage(r))
            body["choices"] = []
            out += sse(body)
        return out + SSE_DONE


def log_facts(r: schemas.GenerateReply) -> dict[str, Any]:
    """What the canonical request log line records of an answer."""
    return {**extension(r), "prompt_tokens": r.prompt_tokens, "completion_tokens": completion_tokens(r),
            "finish_reason": r.finish_reason}
