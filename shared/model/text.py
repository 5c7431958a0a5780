"""Text -> token ids for the sharing path, one rule for every service and tool.

The shared context is tokenized on its own (with the tokenizer's special tokens, e.g. BOS) and
the question on its own (without them), then concatenated: so the context's ids are a prefix of
every prompt over it, whatever the question, which is what makes a sender's cache reusable.
"""

from __future__ import annotations

from typing import Any


def context_ids(tokenizer: Any, context: str) -> list[int]:
    return list(tokenizer(context, add_special_tokens=True)["input_ids"])


def question_ids(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer(question, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids); the prompt is their concatenation."""
    return context_ids(tokenizer, context), question_ids(tokenizer, question)


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
