"""Checkpoints of named model shapes without weights (`model/shapes.py`'s architectures): a
config, the zoo's tokenizer and a seed, random-initialised by `load_model` on the device it loads
to. Real processes (a sender, a receiver) started on one hold the same weights, so latency
through the whole mesh is measured at a real architecture's size without its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import transformers

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model.names import RANDOM_INIT
from droidmesh.shared.model.shapes import SHAPES
from droidmesh.shared.zoo.tokenizer import hf_tokenizer


def write_checkpoint(name: str, path: str | os.PathLike, seed: int = 0, tokenizer: str | os.PathLike | None = None
                     ) -> Path:
    """A checkpoint directory of the named shape without weights (config, the zoo's tokenizer or
    the one in the `tokenizer` directory, `RANDOM_INIT` with `seed`): `load_model`
    random-initialises it on the device it loads to, so services started on it (a sender, a
    receiver) hold the same weights. For latency work (`bench mesh`, the GPU profile check: a
    real model's tokenizer gives its rows' real token counts); quality is meaningless."""
    if name not in SHAPES:
        raise BadRequestError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    family, config = SHAPES[name]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None else hf_tokenizer()
    vocab = max(config["vocab_size"], len(tok))  # every id the tokenizer gives has an embedding (the tiny shape's 512 would not)
    cfg = transformers.AutoConfig.for_model(family, **{**config, "vocab_size": vocab}, bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    (out / RANDOM_INIT).write_text(json.dumps({"seed": seed, "shape": name}))
    return out
