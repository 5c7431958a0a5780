"""What a reply reports of its tokens' log-probabilities (`Sampling.logprobs`, OpenAI's logprobs).

Plain structs inside `schemas.GenerateReply` and its samples: a receiver fills them on its
decode thread, the gateway shapes them into OpenAI's bodies; they carry no version of their own.
"""

from __future__ import annotations

import msgspec


class TopLogprob(msgspec.Struct):
    """One of the likeliest tokens at a position: its id, its text, its log-probability."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct):
    """A chosen token's log-probability under the model's next-token distribution (before
    temperature and top-p), and the `Sampling.logprobs` likeliest tokens there."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []
