"""The zoo tokenizer: one token per zoo word, lossless on code, loadable by AutoTokenizer."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.tasks.suite import stdlib_files
from droidmesh.shared.zoo.tokenizer import WordIds, save_tokenizer


def test_every_zoo_word_is_one_token_and_text_matches_word_ids() -> None:
    """Each zoo word is a single token, and encoding a space-joined text equals the word ids."""
    ids = WordIds()
    words = list(V.KEYS[:3]) + [V.SEP] + list(V.VALUES[:2]) + [V.WHO, V.ALIASES[0]]
    assert ids.encode_text(" ".join(words)) == ids.seq(words)


def test_python_source_roundtrips() -> None:
    """Byte-level: decoding an encoded stdlib file gives the file back (after the prefix space)."""
    ids = WordIds()
    text = Path(stdlib_files()["train"][0]).read_text(encoding="utf-8")[:3000]
    assert ids.decode(ids.encode_text(text)) == " " + text


def test_tokenizer_is_deterministic() -> None:
    """Two builds give the same vocabulary (the tokenizer is a pure function of the word list)."""
    assert WordIds().tok.get_vocab() == WordIds().tok.get_vocab()


def test_autotokenizer_loads_saved_files(tmp_path: Path) -> None:
    """save_tokenizer writes files AutoTokenizer loads, with the same ids and special tokens."""
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = WordIds()
    assert tok("anna amber .", add_special_tokens=False)["input_ids"] == ids.encode_text("anna amber .")
    assert tok.bos_token_id == ids.bos and tok.eos_token_id == ids.eos and tok.pad_token_id == ids.pad
