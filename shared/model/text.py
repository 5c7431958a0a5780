"""Text -> token ids for the sharing path, one rule for every service and tool.

The shared context is tokenized on its own, after the start token (BOS, or EOS for tokenizers
without one), and the question on its own without special tokens, then concatenated: so the
context's ids are a prefix of every prompt over it, whatever the question, which is what makes
a sender's cache reusable. The zoo's task suite encodes rows by the same rule.

A chat is rendered by the tokenizer's chat template, or, without one, by a plain rendering that
keeps the same prefix property for its first message (`chat_prompt_ids`); what a sender caches so
that chats opening with a document reuse it is `chat_prefix_ids`. `request_ids` is the one entry
every path tokenizes through: the gateway's and `droidmesh ask`'s requests on a receiver
(`services/receiver/checks.prompt_ids`), `droidmesh prefill`'s on a sender. Answers are decoded
incrementally, ending before any stop sequence (`TextStream`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from droidmesh.shared.errors import BadRequestError


def start_token(tokenizer: Any) -> list[int]:
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return [int(tid)]
    return []


def context_ids(tokenizer: Any, context: str) -> list[int]:
    return start_token(tokenizer) + list(tokenizer(context, add_special_tokens=False)["input_ids"])


def context_spans(tokenizer: Any, context: str) -> tuple[list[int], list[tuple[int, int] | None]]:
    """`context_ids` and each token's [start, end) characters in `context` (None: the start token),
    what aligns two tokenizations of one context (`kv.translate.align`). Needs a fast tokenizer."""
    enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    start = start_token(tokenizer)
    spans: list[tuple[int, int] | None] = [None] * len(start)
    return start + list(enc["input_ids"]), spans + [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def tokenizer_spec(tokenizer: Any) -> dict[str, str]:
    """A fast tokenizer as plain strings (its `tokenizer.json` and start / end tokens), to travel
    inside another file; `tokenizer_from_spec` rebuilds it."""
    return {"json": tokenizer.backend_tokenizer.to_str(), "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or ""}


def tokenizer_from_spec(spec: dict[str, str]) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec["json"]), bos_token=spec["bos_token"] or None,
                                       eos_token=spec["eos_token"] or None, clean_up_tokenization_spaces=False)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON; any failure means "not a tokenizer"
        raise BadRequestError(f"not a tokenizer: {e}") from e


def question_ids(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer(question, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids); the prompt is their concatenation."""
    return context_ids(tokenizer, context), question_ids(tokenizer, question)


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's own text, special tokens included (what a log-probability is reported for)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


# -- chat ------------------------------------------------------------------------------------
class ChatTurn(Protocol):
    """One chat message (`schemas.ChatMessage` is one); read-only here."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


ASSISTANT_CUE = "\nassistant:"  # the plain rendering's generation prompt


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatTurn]) -> list[int]:
    """A conversation -> the prompt's token ids, ending where the assistant's answer starts.

    With a chat template (the tokenizer's `chat_template`, as saved in `tokenizer_config.json`):
    the template renders it with `add_generation_prompt=True` (transformers 5's
    `apply_chat_template`, tokenized, `return_dict=False` -> list[int]). Reuse then finds whatever
    prefix a sender cached of that rendering.

    Without one (the zoo's tokenizer has none), the plain rendering: the FIRST message's content
    is the shared document, tokenized exactly as `context_ids` does (its role is not rendered),
    and the rest is one question-style text (`question_ids`) of lines `\\n{role}: {content}`
    followed by `\\nassistant:`. So `context_ids(doc)` is an exact token prefix of every chat
    whose first message is `doc`: a document prefilled on a sender is reused by the chat."""
    if not messages:
        raise BadRequestError("chat needs at least one message")
    if has_chat_template(tokenizer):
        return _templated(tokenizer, [messages])[0]
    rest = "".join(f"\n{m.role}: {m.content}" for m in messages[1:]) + ASSISTANT_CUE
    return context_ids(tokenizer, messages[0].content) + question_ids(tokenizer, rest)


def _templated(tokenizer: Any, conversations: Sequence[Sequence[ChatTurn]]) -> list[list[int]]:
    """Each conversation rendered by the chat template with the generation prompt, tokenized in one
    batch. transformers tokenizes the rendered text with `add_special_tokens=False`: a start token
    is there only if the template writes one (`{{ bos_token }}`), never added twice."""
    batch = [[{"role": m.role, "content": m.content} for m in c] for c in conversations]
    out = tokenizer.apply_chat_template(batch, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [[int(t) for t in ids] for ids in out]


@dataclasses.dataclass(frozen=True)
class _Turn:
    role: str
    content: str


# Continuations a chat over the opening turns may have: the answer's cue alone, or a turn of each
# role a request may send (`schemas.Role`). They differ right after the next turn's opening marker
# (its role), so the ids all of them share end where any continuation's own text begins. Where a
# template refuses some (roles must alternate), the rest still hold every role it accepts there.
_PROBES: tuple[tuple[_Turn, ...], ...] = ((), (_Turn("user", "?"),), (_Turn("assistant", "!"),), (_Turn("system", ";"),))


def chat_prefix_ids(tokenizer: Any, messages: Sequence[ChatTurn]) -> list[int]:
    """The token ids every chat that opens with `messages` starts with, whatever follows: what a
    sender prefills so that such chats reuse its cache (`droidmesh prefill --as-chat`).

    Without a chat template: `context_ids` of the first message, the plain rendering's prefix
    (`chat_prompt_ids`; later opening messages are tokenized with the rest, so add nothing sure).

    With one: the longest common prefix of the opening rendered with each of `_PROBES` after it
    (and the generation prompt). Why that is a prefix of every real continuation too: a chat
    template renders turn by turn (SmolLM2's adds its default system turn from `messages[0]` alone),
    so the opening's text is a text prefix of any longer conversation's; and the turn markers of
    real chat tokenizers are special tokens, which the tokenizer splits out before BPE, so no
    merge crosses a turn's end and the text prefix is a token prefix up to the next turn's role,
    where the probes part. A template that renders earlier turns depending on later ones, or
    markers that are plain text, make the probes part sooner (a shorter prefix); and a
    chat that still departs from the cached ids somewhere is not served wrong, it reuses less: the
    broker matches the longest shared prefix token by token. A probe the template refuses (one
    demanding alternating roles) is a chat that cannot arrive, and is skipped."""
    if not messages:
        raise BadRequestError("a chat prefix needs at least one message")
    if not has_chat_template(tokenizer):
        return context_ids(tokenizer, messages[0].content)
    from jinja2 import TemplateError  # transformers' template engine; raise_exception() raises it

    opened: list[ChatTurn] = list(messages)
    chats: list[list[ChatTurn]] = [opened + list(probe) for probe in _PROBES]
    try:
        rendered = _templated(tokenizer, chats)  # one batch: the document is tokenized in parallel
    except TemplateError:
        rendered = []
        for chat in chats:
            try:
                rendered += _templated(tokenizer, [chat])
            except TemplateError:
                continue
    if not rendered:
        raise BadRequestError("the model's chat template refuses every conversation that opens with these messages")
    return rendered[0][: _common_prefix(rendered)]


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


def request_ids(tokenizer: Any, context: str = "", question: str = "", chat: Sequence[ChatTurn] | None = None,
                *, prefix: bool = False) -> list[int]:
    """A request's text -> its token ids: the one rule for the gateway, `ask` and `prefill`.

    `chat` None: `context_ids(context) + question_ids(question)` (a completion is context=prompt,
    question=""; `ask` sends its context and question as they are). With `chat`: the rendered
    chat (`chat_prompt_ids`; then context and question are unused). `prefix=True` asks what a
    sender caches for such requests: `context_ids(context)`, or `chat_prefix_ids(chat)`."""
    if chat is not None:
        return chat_prefix_ids(tokenizer, chat) if prefix else chat_prompt_ids(tokenizer, chat)
    if prefix:
        return context_ids(tokenizer, context)
    return context_ids(tokenizer, context) + question_ids(tokenizer, question)


# -- streaming detokenization with stop sequences ---------------------------------------------
REPLACEMENT = "\ufffd"  # what a decoder writes for a UTF-8 sequence cut short by a token boundary
MAX_STOPS = 4
MAX_STOP_CHARS = 64


def check_stop(stop: Sequence[str]) -> None:
    """Stop strings a request may ask for: at most MAX_STOPS, each 1..MAX_STOP_CHARS characters."""
    if len(stop) > MAX_STOPS:
        raise BadRequestError(f"at most {MAX_STOPS} stop strings, got {len(stop)}")
    for s in stop:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise BadRequestError(f"a stop string must be 1..{MAX_STOP_CHARS} characters, got {len(s)}")


class TextStream:
    """Token ids in, text deltas out, ending before the first stop sequence.

    Each `push` decodes the whole id list and emits what is new since the last delta, except a
    tail that is held back: trailing U+FFFD (half of a multi-byte character; the next token may
    complete it) and the longest tail that is the start of some stop string (it may yet become
    one). Invariant: everything emitted is a prefix of the final text, and the final text (`text`)
    ends right before the first occurrence of any stop string (or is the whole decoding). After a
    stop `push` emits nothing more; `finish` flushes the held-back tail when decoding ended
    otherwise (EOS, max_new_tokens)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]  # an empty stop string would match at once: ignored
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text emitted so far
        self.stopped = False
        self.text = ""  # the final text once stopped or finished; the emitted part until then

    def push(self, token_id: int) -> tuple[str, bool]:
        """(new text to emit, whether a stop sequence has now occurred)."""
        if self.stopped:
            return "", True
        self.ids.append(int(token_id))
        full = decode(self.tokenizer, self.ids)
        if self._cut(full):
            return self._emit(self.text), True
        stable = full.rstrip(REPLACEMENT)
        return self._emit(stable[: len(stable) - self._held(stable)]), False

    def finish(self) -> str:
        """The rest of the text once decoding is over (nothing after a stop)."""
        if self.stopped:
            return ""
        full = decode(self.tokenizer, self.ids)
        if not self._cut(full):
            self.text = full
        return self._emit(self.text)

    def _cut(self, full: str) -> bool:
        """If a stop string occurs in `full`: stop, keep the text before the first one."""
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.stopped, self.text = True, full[: min(hits)]
        return True

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _emit(self, upto: str) -> str:
        """The part of `upto` past what was already emitted (a decoder that rewrote earlier text,
        which byte-level decoders never do, only loses the rewritten part of the stream)."""
        delta = upto[self.sent :] if len(upto) > self.sent else ""
        self.sent = max(self.sent, len(upto))
        if not self.stopped:
            self.text = upto if len(upto) >= len(self.text) else self.text
        return delta
