"""What a generate request may ask of a receiver, checked before any work, its prompt and its deadline.

Called by `handlers.generate` (and `answer.py` for `check_deadline`), on the event loop; nothing
here blocks except `prompt_ids`, which tokenizes (the handler calls it inline: prompts are bounded
by `max_prompt_chars` and `check_room` first). Nothing the client sent is trusted: every check
raises `BadRequestError` with a one-line message naming the first bad field (the client gets it as
an ErrorReply); `check_deadline` raises `DeadlineExceededError`.

The limits bound what one request can cost: decode steps (`max_new_tokens_limit`), tokenization
(`max_prompt_chars`, and `check_room`: characters that could not fit the model's positions are
refused before any tokenizing), positions (the model's `max_position_embeddings`), stop matching
(4 strings of 64 characters) and where chunks may go (`check_stream_subject`: a stream inbox only,
never a mesh subject such as `dm.cache.available` nor anyone's reply subject).
"""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING

from droidmesh.shared.errors import BadRequestError, DeadlineExceededError
from droidmesh.shared.kv.partial import MAX_LOGPROBS, MAX_SAMPLES
from droidmesh.shared.model import sampling, text
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.generation import GenerateRequest

if TYPE_CHECKING:
    from droidmesh.services.receiver.config import ReceiverConfig

MAX_CHAT_MESSAGES = 64
MAX_STREAM_SUBJECT = 128

# A stream inbox is exactly `_INBOX.<token>` or a user's own `_INBOX_<user>.<token>`
# (subjects.inbox_prefix), the token 16-64 letters and digits: what a client's fresh inbox is
# (nats-py's `new_inbox()`, a uuid in process). Reply subjects have one more token (a client's
# request inbox is `<prefix>.<id>.<n>`), so chunks can never be aimed at anyone's pending request
# replies; a stream inbox's token is random, and chunks to one nobody subscribes to stop the
# request at once (`answer_stream.ListenerWatch`). Which user's prefix a receiver may publish
# under at all is NATS permissions' call.
_STREAM_SUBJECT = re.compile(rf"^{subjects.INBOX_PREFIX}(_[A-Za-z0-9_-]+)?\.[A-Za-z0-9]{{16,64}}$")


def check(req: GenerateRequest, cfg: ReceiverConfig) -> None:
    limit = cfg.max_new_tokens_limit
    if not 1 <= req.max_new_tokens <= limit:
        raise BadRequestError(f"max_new_tokens must be in [1, {limit}] (max_new_tokens_limit), got {req.max_new_tokens}")
    sampling.check_sampling(req.sampling.temperature, req.sampling.top_p, req.sampling.seed)
    text.check_stop(req.sampling.stop)
    if not 1 <= req.n <= MAX_SAMPLES:
        raise BadRequestError(f"n must be in [1, {MAX_SAMPLES}], got {req.n}")
    if req.n > 1 and req.stream_subject:
        raise BadRequestError("n > 1 is answered whole, not streamed")
    if req.sampling.logprobs is not None and not 0 <= req.sampling.logprobs <= MAX_LOGPROBS:
        raise BadRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.sampling.logprobs}")
    check_stream_subject(req.stream_subject)
    if req.chat is not None:
        if not 1 <= len(req.chat) <= MAX_CHAT_MESSAGES:
            raise BadRequestError(f"chat must hold 1..{MAX_CHAT_MESSAGES} messages, got {len(req.chat)}")
        if req.context or req.question:
            raise BadRequestError("a chat request carries its text in chat; context and question must be empty")
    chars = prompt_chars(req)
    if chars > cfg.max_prompt_chars:
        raise BadRequestError(f"prompt of {chars} characters exceeds max_prompt_chars={cfg.max_prompt_chars}")


def prompt_chars(req: GenerateRequest) -> int:
    """The prompt's characters: context + question, or every chat message's content."""
    if req.chat is not None:
        return sum(len(m.content) for m in req.chat)
    return len(req.context) + len(req.question)


def check_room(model: object, chars: int, max_new_tokens: int) -> None:
    """Refuse, before tokenizing, a prompt of `chars` characters that could not fit the model's
    positions even if every token were as long as its vocabulary's longest (`_longest_token`):
    a prompt near the body cap is then refused at once instead of after tokenizing it on the
    event loop. (A token's text is never longer than its vocabulary entry: byte-level entries
    spell each byte, so the bound holds for any text; a template or special tokens only add.)"""
    limit = _positions(model)
    per_token = _longest_token(getattr(model, "tokenizer", None))
    if limit is None or not per_token:
        return
    room = max(0, limit - max_new_tokens)
    if chars > room * per_token:
        raise BadRequestError(f"prompt of {chars} characters cannot fit the model's {limit} positions "
                              f"(max_position_embeddings) with max_new_tokens {max_new_tokens}: even at "
                              f"{per_token} characters per token it needs more; shorten the context")


_LONGEST: dict[int, tuple[object, int]] = {}  # id(tokenizer) -> (the tokenizer, kept so the id stays its own; longest entry)


def _longest_token(tokenizer: object) -> int:
    """The longest entry of `tokenizer`'s vocabulary, in characters (0: unknown), computed once."""
    if tokenizer is None:
        return 0
    known = _LONGEST.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}
    longest = max((len(t) for t in vocab), default=0)
    _LONGEST[id(tokenizer)] = (tokenizer, longest)
    return longest


def _positions(model: object) -> int | None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_positions(model: object, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse up front a prompt the model has no positions for (`max_position_embeddings`):
    prompt + new tokens must fit, else the request would only run long and fail late."""
    limit = _positions(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise BadRequestError(f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the "
                              f"model's {limit} positions (max_position_embeddings); shorten the context")


def check_stream_subject(subject: str) -> None:
    """"" (no streaming) or a stream inbox (see `_STREAM_SUBJECT`)."""
    if not subject:
        return
    if len(subject) > MAX_STREAM_SUBJECT:
        raise BadRequestError(f"stream_subject longer than {MAX_STREAM_SUBJECT} characters")
    if not _STREAM_SUBJECT.match(subject):
        raise BadRequestError("stream_subject must be a fresh stream inbox (_INBOX.<token> or _INBOX_<user>.<token>, "
                              f"the token 16-64 letters and digits), got {subject[:64]!r}")


def prompt_ids(tokenizer: object, req: GenerateRequest) -> list[int]:
    """The request's prompt tokens by the one rule every path uses (`text.request_ids`): the chat
    rendered, or context + question (a completions-style prompt is `context=prompt, question=""`:
    its ids are exactly `context_ids(prompt)`, so a sender's cache of any token prefix of it is
    found; a chat finds what `prefill --as-chat` cached of its opening)."""
    return text.request_ids(tokenizer, req.context, req.question, req.chat)


def deadline_of(req: GenerateRequest, arrived: float, default_s: float) -> float:
    """The request's deadline on this host's monotonic clock: `budget_s` after it arrived (immune
    to clock skew between client and receiver), else its absolute `deadline`, else the default."""
    if not math.isfinite(req.budget_s) or req.budget_s < 0:
        raise BadRequestError(f"budget_s must be a finite number of seconds >= 0, got {req.budget_s}")
    if req.budget_s > 0:
        return arrived + req.budget_s
    if req.deadline:
        if not math.isfinite(req.deadline):
            raise BadRequestError(f"deadline must be finite unix seconds, got {req.deadline}")
        return arrived + (req.deadline - time.time())
    return arrived + default_s


def check_deadline(deadline: float, stage: str) -> None:
    """Drop the request once `deadline` (time.monotonic()) has passed: nobody waits for its answer."""
    late = time.monotonic() - deadline
    if late >= 0:
        raise DeadlineExceededError(f"deadline passed {late:.3f}s {stage}; dropped")
