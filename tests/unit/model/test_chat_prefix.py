"""What `prefill --as-chat` caches (`text.chat_prefix_ids`): with a chat template that writes a
default system turn (SmolLM2-Instruct's), the ids of a chat's opening are a prefix of every chat
that opens with it, whatever follows; without a template they are the plain context's."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model import text
from droidmesh.shared.wire.schemas import ChatMessage
from droidmesh.shared.zoo.manifest import zoo_dir
from droidmesh.shared.zoo.tokenizer import hf_tokenizer

# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json holds it.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"
DOC = " ".join(["alpha beta gamma delta"] * 10)
REAL_BASE = zoo_dir("real") / "base"


def smol_tokenizer(special_markers: bool = True):
    """The zoo tokenizer with SmolLM2's template. `special_markers`: `<|im_start|>` / `<|im_end|>`
    are special tokens, as in SmolLM2's own tokenizer; else plain text spelled in bytes, as in a zoo
    checkpoint given the template (its vocabulary cannot grow without its model's embeddings)."""
    tok = hf_tokenizer()
    tok.chat_template = SMOL_TEMPLATE
    if special_markers:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def continuations(doc: str) -> list[list[ChatMessage]]:
    """Chats whose first user message is `doc`, followed by what OpenAI clients send."""
    first = ChatMessage("user", doc)
    return [
        [first],
        [first, ChatMessage("user", "what is gamma?")],
        [first, ChatMessage("user", "\nwhat is gamma?")],  # starts with what the template writes around it
        [first, ChatMessage("assistant", "delta"), ChatMessage("user", "and beta?")],
        [first, ChatMessage("system", "be brief"), ChatMessage("user", "why")],
    ]


def assert_prefix_of_every_chat(tok, opening: list[ChatMessage], chats: list[list[ChatMessage]]) -> list[int]:
    prefix = text.chat_prefix_ids(tok, opening)
    for chat in chats:
        ids = text.chat_prompt_ids(tok, chat)
        assert ids[: len(prefix)] == prefix, [m.content for m in chat]
    return prefix


@pytest.mark.parametrize("special_markers", [True, False], ids=["special-markers", "text-markers"])
def test_chat_prefix_holds_the_default_system_turn_and_the_document(special_markers):
    """The prefix of a document sent as the first user turn: a prefix of every chat opening with it,
    holding the template's default system turn and the whole document; a plain prefill of the
    document (`context_ids`) is a prefix of none of them, which is why chats never reused it."""
    tok = smol_tokenizer(special_markers)
    prefix = assert_prefix_of_every_chat(tok, [ChatMessage("user", DOC)], continuations(DOC))
    shown = tok.decode(prefix)
    assert shown.index(DEFAULT_SYSTEM) < shown.index(DOC.split()[0]) and DOC in shown
    assert shown.rstrip().endswith("<|im_start|>")  # through the document's turn, up to the next turn's role
    assert all(len(text.chat_prompt_ids(tok, c)) > len(prefix) for c in continuations(DOC))
    plain = text.context_ids(tok, DOC)
    assert all(text.chat_prompt_ids(tok, c)[: len(plain)] != plain for c in continuations(DOC))


def test_a_system_message_replaces_the_default_one():
    """An opening with its own system message (`prefill --as-chat --system`) is a prefix of chats
    that send that system message, and holds no default system turn."""
    tok = smol_tokenizer()
    opening = [ChatMessage("system", "You answer from the document."), ChatMessage("user", DOC)]
    prefix = assert_prefix_of_every_chat(tok, opening, [[opening[0], *c] for c in continuations(DOC)])
    assert DEFAULT_SYSTEM not in tok.decode(prefix)


def test_template_that_refuses_a_probe_still_gives_a_prefix():
    """A template demanding alternating roles refuses the probe of a second user turn; the prefix
    comes from the continuations it accepts and is a prefix of the chats it accepts."""
    tok = smol_tokenizer()
    alternate = ("{% if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}"
                 "{{ raise_exception('roles must alternate') }}{% endif %}")
    tok.chat_template = SMOL_TEMPLATE.replace("{% if loop.first", alternate + "{% if loop.first", 1)
    with pytest.raises(Exception, match="alternate"):
        text.chat_prompt_ids(tok, continuations(DOC)[1])
    chats = [c for c in continuations(DOC) if [m.role for m in c][:2] != ["user", "user"]]
    assert_prefix_of_every_chat(tok, [ChatMessage("user", DOC)], chats)


def test_template_that_refuses_the_opening_is_a_bad_request():
    tok = smol_tokenizer()
    tok.chat_template = "{{ raise_exception('no chats here') }}"
    with pytest.raises(BadRequestError, match="refuses"):
        text.chat_prefix_ids(tok, [ChatMessage("user", DOC)])


def test_without_a_template_the_prefix_is_the_plain_context():
    """No chat template: the first message tokenized as `context_ids`, what chats render first."""
    tok = hf_tokenizer()
    prefix = assert_prefix_of_every_chat(tok, [ChatMessage("user", DOC)], continuations(DOC))
    assert prefix == text.context_ids(tok, DOC)
    with pytest.raises(BadRequestError):
        text.chat_prefix_ids(tok, [])


def test_chat_ids_are_transformers_own_rendering():
    """The batched rendering equals `apply_chat_template` of the one conversation: no start token
    added on top of what the template writes."""
    tok = smol_tokenizer()
    chat = continuations(DOC)[3]
    want = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in chat], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert text.chat_prompt_ids(tok, chat) == list(want) and want[0] != tok.bos_token_id


@pytest.mark.skipif(not (REAL_BASE / "tokenizer_config.json").is_file(),
                    reason=f"the real tier's base ({REAL_BASE}) is not built (droidmesh zoo build --tier real)")
def test_real_smollm2_tokenizer_keeps_the_prefix_property():
    """SmolLM2-135M-Instruct's own tokenizer and template: the opening's ids, default system turn
    included, are a prefix of every chat over the document, and cover the whole document."""
    tok = AutoTokenizer.from_pretrained(str(REAL_BASE))
    assert text.has_chat_template(tok)
    doc = "The Treaty of Westphalia was signed in 1648.\n\nIt ended the Thirty Years' War. "
    prefix = assert_prefix_of_every_chat(tok, [ChatMessage("user", doc)], continuations(doc))
    shown = tok.decode(prefix)
    assert "system" in shown and doc in shown
    full = text.chat_prompt_ids(tok, continuations(doc)[1])
    assert len(prefix) > len(text.question_ids(tok, doc))  # the system turn and the document's turn
    assert len(full) - len(prefix) < 32  # only the question's turn and the answer's cue are left to prefill
