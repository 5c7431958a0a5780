"""A generate request and the chunks streamed back while it decodes (the reply is `schemas.GenerateReply`).

Clients (the gateway, `droidmesh ask`, benchmarks) encode them with `schemas.encode`; a receiver
decodes them on its event loop with `schemas.decode`, which bounds the message's size and checks
every field's type. Nothing else is trusted: the receiver checks what a request may ask
(`services/receiver/checks.py`).
"""

from __future__ import annotations

import msgspec

from droidmesh.shared.wire.hashing import PUBLIC
from droidmesh.shared.wire.schemas import ChatMessage, Message, Mode, Scope


class Sampling(msgspec.Struct, kw_only=True):
    """How the next token is chosen. temperature 0 is greedy (and ignores top_p and seed)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # same seed, prompt and plan: same tokens
    stop: list[str] = []  # the answer ends before the first occurrence of any of these
    logprobs: int | None = None  # None: none; k in 0..20: each token's log-probability and the k likeliest tokens'


class GenerateRequest(Message, tag="generate.request"):
    """The prompt is `context` followed by `question` (each tokenized on its own, see
    `shared/model/text.py`), or, with `chat`, the conversation rendered by the receiver's chat
    template (then `context` and `question` are empty). Either way the receiver reuses the longest
    cached prefix of the prompt's tokens it finds."""

    request_id: str
    context: str  # the shared document (the sender's prefix)
    question: str
    max_new_tokens: int = 32
    deadline: float = 0.0  # unix seconds; 0 = the service's default
    mode: Mode = "auto"
    ttft_slo_ms: float = 0.0  # 0 = none; lets an idle receiver spend spare time on quality
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    chat: list[ChatMessage] | None = None
    stream_subject: str = ""  # "" = no streaming; else GenerateChunks go there (an inbox: subjects.INBOX_PREFIX)
    budget_s: float = 0.0  # seconds the client waits, counted from arrival (no clocks compared); 0 = use `deadline`
    scope: Scope = PUBLIC  # whose cached contexts it may reuse (its own scope's and public ones); a sender caches it there
    n: int = 1  # samples of the answer (OpenAI's n): the reply's own fields are the first, `samples` the others


class GenerateChunk(Message, tag="generate.chunk"):
    """One streamed piece of an answer, published while decoding; the final GenerateReply still
    carries the whole text (a client that missed a chunk completes from it)."""

    request_id: str
    index: int  # 0, 1, 2, ... per request
    text: str  # new text since the previous chunk (held back while it could start a stop sequence)
    token_ids: list[int]
