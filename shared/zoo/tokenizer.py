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

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from droidmesh.shared.zoo import vocab

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL = (PAD, BOS, EOS)
SPACE = "\u0120"  # byte-level's printable stand-in for " "


def _byte_alphabet() -> list[str]:
    return sorted(ByteLevel.alphabet())


def build_tokenizer() -> Tokenizer:
    """A `tokenizers.Tokenizer`: ids 0..2 special, then 256 bytes, then merged words."""
    tokens: list[str] = list(SPECIAL) + _byte_alphabet()
    merges: list[tuple[str, str]] = []
    seen = set(tokens)
    for word in vocab.ALL_WORDS:
        left = SPACE
        for ch in word:
            # Every symbol must be the byte-level spelling; zoo words are ASCII so ch is itself.
            right = left + ch
            if right not in seen:
                merges.append((left, ch))
                tokens.append(right)
                seen.add(right)
            left = right
    vocab_map = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=merges, fuse_unk=False))
    # add_prefix_space: a text's first word gets the same Ġ-token as everywhere else.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def hf_tokenizer() -> PreTrainedTokenizerFast:
    """The transformers wrapper (what `AutoTokenizer.from_pretrained` returns after `save`)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json into `out_dir`."""
    hf_tokenizer().save_pretrained(str(out_dir))


def _special(tok: Tokenizer, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"the zoo tokenizer lacks {token!r}")
    return tid


class WordIds:
    """word -> token id for the zoo words (each a single space-prefixed token)."""

    def __init__(self, tok: Tokenizer | None = None) -> None:
        tok = tok or build_tokenizer()
        self.tok = tok
        self.ids: dict[str, int] = {}
        for w in vocab.ALL_WORDS:
            enc = tok.encode(" " + w, add_special_tokens=False).ids
            assert len(enc) == 1, f"zoo word {w!r} is not a single token: {enc}"
            self.ids[w] = enc[0]
        self.bos = _special(tok, BOS)
        self.eos = _special(tok, EOS)
        self.pad = _special(tok, PAD)
        self.vocab_size = tok.get_vocab_size()

    def __getitem__(self, word: str) -> int:
        return self.ids[word]

    def seq(self, words: list[str] | tuple[str, ...]) -> list[int]:
        return [self.ids[w] for w in words]

    def encode_text(self, text: str) -> list[int]:
        """Any text (code included) -> ids, no special tokens."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
