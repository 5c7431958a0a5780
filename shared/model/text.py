"""Text -> token ids for the sharing path, one rule for every service and tool.

The shared context is tokenized on its own, after the start token (BOS, or EOS for tokenizers
without one), and the question on its own without special tokens, then concatenated: so the
context's ids are a prefix of every prompt over it, whatever the question, which is what makes
a sender's cache reusable. The zoo's task suite encodes rows by the same rule.
"""

from __future__ import annotations

from typing import Any


def start_token(tokenizer: Any) -> list[int]:
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return [int(tid)]
    return []


def context_ids(tokenizer: Any, context: str) -> list[int]:
    return start_token(tokenizer) + list(tokenizer(context, add_special_tokens=False)["input_ids"])


def question_ids(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer(question, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids); the prompt is their concatenation."""
    return context_ids(tokenizer, context), question_ids(tokenizer, question)


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
