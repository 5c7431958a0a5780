"""The zoo tokenizer: byte-level BPE whose merges are written by hand, not trained.

Why this shape: synthetic tasks need every zoo word to be exactly one token (so a fact is
`key value .`, three tokens), while code completion needs real Python source to round-trip
losslessly (indentation, newlines, any byte). Byte-level BPE gives both: 256 byte tokens cover
every text, and for each word we add the merge chain `Ġ+a -> Ġa, Ġa+n -> Ġan, ...` that fuses
the space-prefixed word into one token. Hand-written merges make the tokenizer a pure function
of `vocab.ALL_WORDS` (deterministic, no training), saved as an ordinary `tokenizer.json` that
`AutoTokenizer.from_pretrained` loads.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from droidmesh.shared.tasks import vocab

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL = (PAD, BOS, EOS)
SPACE = "\u0120"  # byte-level's printable stand-in for " "


VARIANTS = ("zoo", "split")
"""`zoo`: every zoo word one token. `split`: another vocabulary over the same text, for a model of
another family: word tokens come before the bytes (other ids) and every filler word is two tokens
(a space-prefixed head and a bare tail), so the two tokenizations of one text have different
lengths and boundaries and a cache moved between them must be aligned by character offsets."""


def _byte_alphabet() -> list[str]:
    return sorted(ByteLevel.alphabet())


def _chain(piece: str) -> list[tuple[str, str]]:
    """Merges that fuse `piece` left to right from its first symbol."""
    return [(piece[:i], piece[i]) for i in range(1, len(piece))]


def _assemble(pieces: dict[str, tuple[str, ...]], variant: str) -> Tokenizer:
    flat = [p for w in vocab.ALL_WORDS for p in pieces[w]]
    # Space-prefixed chains rank before bare tails: BPE applies the lowest-ranked pair first, so a
    # word's head always fuses before a tail merge could take one of its letters.
    heads = [m for p in flat if p.startswith(SPACE) for m in _chain(p)]
    tails = [m for p in flat if not p.startswith(SPACE) for m in _chain(p)]
    merges = list(dict.fromkeys(heads + tails))
    merged = [a + b for a, b in merges]
    tokens = list(SPECIAL) + (_byte_alphabet() + merged if variant == "zoo" else list(reversed(merged)) + _byte_alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # add_prefix_space: a text's first word gets the same Ġ-token as everywhere else.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def _mismatched(tok: Tokenizer, pieces: dict[str, tuple[str, ...]]) -> list[str]:
    return [w for w, ps in pieces.items()
            if tok.encode(" " + w, add_special_tokens=False).tokens != list(ps)]


@functools.lru_cache(maxsize=len(VARIANTS))
def word_pieces(variant: str) -> dict[str, tuple[str, ...]]:
    """The tokens (byte-level spelling) of every space-prefixed zoo word in `variant`.

    `split` cuts a filler word after its first half; where another word's merges would then
    swallow a letter across the cut (`town` beside `tower`), the cut moves right, and a word with
    no clean cut stays whole. Deterministic: a pure function of `vocab.ALL_WORDS`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tokenizer variant {variant!r}; expected one of {VARIANTS}")
    pieces: dict[str, tuple[str, ...]] = {w: (SPACE + w,) for w in vocab.ALL_WORDS}
    if variant == "zoo":
        return pieces
    cut = {w: (len(w) + 1) // 2 for w in vocab.FILLER if len(w) > 1}
    while True:
        for w, h in cut.items():
            pieces[w] = (SPACE + w[:h], w[h:]) if h < len(w) else (SPACE + w,)
        bad = [w for w in _mismatched(_assemble(pieces, variant), pieces) if cut.get(w, len(w)) < len(w)]
        if not bad:
            return pieces
        for w in bad:
            cut[w] += 1


def build_tokenizer(variant: str = "zoo") -> Tokenizer:
    """A `tokenizers.Tokenizer`. `zoo`: ids 0..2 special, then 256 bytes, then merged words.
    `split`: special, then the word pieces, then the bytes (`VARIANTS`)."""
    return _assemble(word_pieces(variant), variant)


def hf_tokenizer(variant: str = "zoo") -> PreTrainedTokenizerFast:
    """The transformers wrapper (what `AutoTokenizer.from_pretrained` returns after `save`)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(variant), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: str | Path, variant: str = "zoo") -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json into `out_dir`."""
    hf_tokenizer(variant).save_pretrained(str(out_dir))


def _special(tok: Tokenizer, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"the zoo tokenizer lacks {token!r}")
    return tid


class WordIds:
    """word -> token ids for the zoo words: one space-prefixed token each (two for a filler word
    in the `split` variant)."""

    def __init__(self, tok: Tokenizer | None = None, variant: str = "zoo") -> None:
        tok = tok or build_tokenizer(variant)
        self.tok = tok
        self.pieces: dict[str, tuple[int, ...]] = {}
        for w in vocab.ALL_WORDS:
            enc = tuple(tok.encode(" " + w, add_special_tokens=False).ids)
            want = tuple(tok.token_to_id(p) for p in word_pieces(variant)[w])
            assert enc == want, f"zoo word {w!r} tokenizes as {enc}, not its pieces {want}"
            self.pieces[w] = enc
        self.bos = _special(tok, BOS)
        self.eos = _special(tok, EOS)
        self.pad = _special(tok, PAD)
        self.vocab_size = tok.get_vocab_size()

    def __getitem__(self, word: str) -> int:
        """The id of a one-token word (keys, values, structure: one token in every variant)."""
        (tid,) = self.pieces[word]
        return tid

    def seq(self, words: list[str] | tuple[str, ...]) -> list[int]:
        return [t for w in words for t in self.pieces[w]]

    def seq_mask(self, words: list[str] | tuple[str, ...], mask: list[int]) -> tuple[list[int], list[int]]:
        """`seq(words)` and the per-word target mask spread over each word's tokens."""
        return self.seq(words), [m for w, m in zip(words, mask, strict=True) for _ in self.pieces[w]]

    def encode_text(self, text: str) -> list[int]:
        """Any text (code included) -> ids, no special tokens."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
