"""Streaming detokenization with stop strings, and chat rendering's prefix property."""

from __future__ import annotations

import pytest

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model import text
from droidmesh.shared.model.text import TextStream, chat_prompt_ids, context_ids
from droidmesh.shared.wire.schemas import ChatMessage
from droidmesh.shared.zoo.tokenizer import hf_tokenizer


@pytest.fixture(scope="module")
def tok():
    return hf_tokenizer()


def _ids(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def _run(tok, ids: list[int], stop: list[str]) -> tuple[list[str], TextStream]:
    ts, deltas = TextStream(tok, stop), []
    for i in ids:
        delta, stopped = ts.push(i)
        deltas.append(delta)
        if stopped:
            break
    deltas.append(ts.finish())
    return deltas, ts


def test_no_stop_streams_the_whole_decoding(tok):
    """Without stop strings the deltas concatenate to the plain decode of every id."""
    ids = _ids(tok, "alpha beta, gamma delta")
    deltas, ts = _run(tok, ids, [])
    assert "".join(deltas) == ts.text == text.decode(tok, ids) and not ts.stopped


def test_stop_split_across_tokens_is_never_emitted(tok):
    """A stop string spelled over several byte tokens ends the text right before it."""
    ids = _ids(tok, "alpha beta STOPX gamma")
    deltas, ts = _run(tok, ids, ["STOP"])
    assert ts.stopped and ts.text == " alpha beta "
    assert "".join(deltas) == ts.text and "S" not in "".join(deltas)
    assert len(ts.ids) < len(ids)  # decoding stopped at the token completing the stop


def test_partial_stop_is_held_back_then_flushed(tok):
    """Text that could start a stop string is held, and flushed by finish when it never does."""
    ids = _ids(tok, "alpha ST")
    ts = TextStream(tok, ["STOP"])
    emitted = "".join(ts.push(i)[0] for i in ids)
    assert emitted == " alpha "  # " ST" could still become " STOP"
    assert ts.finish() == "ST" and ts.text == " alpha ST" and not ts.stopped


def test_multibyte_characters_are_never_split(tok):
    """Byte tokens of one character emit nothing until the character is whole (no U+FFFD)."""
    ids = _ids(tok, " café 日本")
    deltas, ts = _run(tok, ids, [])
    assert all(text.REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == " café 日本"


def test_earliest_stop_wins(tok):
    """With several stop strings the text ends before whichever occurs first."""
    deltas, ts = _run(tok, _ids(tok, "one two three four"), [" four", " two"])
    assert ts.text == " one" and "".join(deltas) == " one"


@pytest.mark.parametrize("stop,match", [(["a"] * 5, "at most 4"), (["x" * 65], "1..64"), ([""], "1..64")])
def test_stop_limits(stop, match):
    """Too many or too long stop strings are bad requests."""
    with pytest.raises(BadRequestError, match=match):
        text.check_stop(stop)


def test_plain_chat_starts_with_the_first_message_as_a_context(tok):
    """Without a chat template, context_ids(first message) is an exact prefix of the chat's ids."""
    doc = " ".join(["alpha beta gamma delta"] * 10)
    assert not text.has_chat_template(tok)
    chat = [ChatMessage("system", doc), ChatMessage("user", "what is gamma?"),
            ChatMessage("assistant", "delta"), ChatMessage("user", "and beta?")]
    ids = chat_prompt_ids(tok, chat)
    prefix = context_ids(tok, doc)
    assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)
    assert text.decode(tok, ids[len(prefix):]).endswith("\nuser: and beta?\nassistant:")


def test_chat_template_is_used_when_present(tok):
    """A tokenizer with a chat template renders through it, generation prompt included."""
    templated = hf_tokenizer()
    templated.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    ids = chat_prompt_ids(templated, [ChatMessage("user", "hello")])
    assert ids == _ids(templated, "[user] hello\n[assistant]")


def test_empty_chat_is_a_bad_request(tok):
    """A chat needs at least one message."""
    with pytest.raises(BadRequestError):
        chat_prompt_ids(tok, [])
