"""A LongBench-style row as token ids, and generated ids back to an answer text.

The one place prompts are built and answers cut: the scorer (eval, profile, bench quality) and
the demo (which gets text back from a receiver service) score the same answer text.
"""

from __future__ import annotations

import hashlib
from typing import Any

from droidmesh.shared.tasks.spec import TaskSpec


def document_id(context: str) -> str:
    """The id of a row's context: rows asking about one document share it (an interval resamples
    them together: they are not independent)."""
    return hashlib.sha1(context.encode()).hexdigest()[:12]


def encode_row(tokenizer: Any, row: dict[str, Any], spec: TaskSpec) -> tuple[list[int], list[int], list[int]]:
    """(context ids with <bos>, question ids, gold answer ids) for a row.

    The answer is tokenized in place (prompt text + joiner + answer, minus the prompt's ids)
    so that e.g. a code line keeps its exact indentation tokens."""
    tok = _Tok(tokenizer)
    ctx = [tok.bos] + tok.encode(row["context"])
    q = tok.encode(row["input"]) if row["input"].strip() else []
    prompt_text = row["context"] + (" " + row["input"] if q else "")
    base = tok.encode(prompt_text)
    full = tok.encode(prompt_text + spec.joiner + row["answers"][0])
    ans = full[len(base):] if full[: len(base)] == base else tok.encode(row["answers"][0])
    return ctx, q, ans


class _Tok:
    """Uniform view over the zoo's word tokenizer (`encode_text`, `bos`) or any HF tokenizer."""

    def __init__(self, t: Any) -> None:
        if hasattr(t, "encode_text"):
            self.bos = t.bos
            self.encode = t.encode_text
        else:
            self.bos = t.bos_token_id if t.bos_token_id is not None else t.eos_token_id
            self.encode = lambda s: t(s, add_special_tokens=False)["input_ids"]


def answer_text(text: str, spec: TaskSpec) -> str:
    """A generated text as the answer the metric scores: stripped first (code keeps its
    indentation: only leading newlines go), then cut at the first stop string. Stripping comes
    first because models often open an answer with blank lines, and a stop string of "\n"
    applied before that would leave every answer empty."""
    text = text.lstrip("\n") if spec.metric == "edit_sim" else text.lstrip()
    cuts = [text.index(s) for s in spec.stop if s in text]
    if cuts:
        text = text[: min(cuts)]
    return text if spec.metric == "edit_sim" else text.strip()


def decode_answer(tokenizer: Any, token_ids: list[int], spec: TaskSpec) -> str:
    """Generated ids -> answer text (see `answer_text`)."""
    return answer_text(tokenizer.decode(token_ids, skip_special_tokens=True), spec)
