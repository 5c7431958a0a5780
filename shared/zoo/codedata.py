"""Training windows of real Python source (the interpreter's standard library) for code fine-tunes."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

from droidmesh.shared.tasks.suite import stdlib_files
from droidmesh.shared.zoo.tokenizer import WordIds


@lru_cache(maxsize=1)
def _ids() -> WordIds:
    return WordIds()


@lru_cache(maxsize=512)
def _file_ids(path: str) -> tuple[int, ...]:
    return tuple(_ids().encode_text(Path(path).read_text(encoding="utf-8", errors="replace")))


def code_sampler(seq_len: int):
    """rng -> (ids with <bos>, mask): a random `seq_len`-token window of a train-split stdlib
    file, next-token loss on every token (plain LM fine-tuning on code)."""
    files = stdlib_files()["train"]

    def sample(rng: random.Random) -> tuple[list[int], list[int]]:
        while True:
            toks = _file_ids(rng.choice(files))
            if len(toks) > seq_len + 1:
                break
        start = rng.randrange(0, len(toks) - seq_len)
        window = list(toks[start : start + seq_len])
        return [_ids().bos] + window, [0] + [1] * seq_len

    return sample
