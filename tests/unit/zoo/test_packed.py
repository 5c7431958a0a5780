"""Committed weights kept packed (`shared/zoo/packed.py`) and the real tier's adapters read through
it (`shared/zoo/real.py`): the bytes a tier is built from are the bytes its manifest hashes."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from droidmesh.shared.errors import CheckpointNotFoundError
from droidmesh.shared.zoo import packed, real
from droidmesh.shared.zoo.manifest import REPO_ZOO

DATA = bytes(range(256)) * 4096 + b"\x00" * (1 << 20)  # 2 MiB, half of it runs of one byte
WANT = hashlib.sha256(DATA).hexdigest()
NAME = "adapter_model.safetensors"


def _packed_file(d: Path, name: str = NAME, data: bytes = DATA) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    (d / name).chmod(0o644)
    p = packed.pack(d / name)
    (d / name).unlink()
    return p


def _adapter(tmp_path: Path) -> tuple[Path, dict]:
    """A committed-looking adapter folder, its weights packed, and its manifest entry."""
    src = tmp_path / "repo" / "docqa"
    _packed_file(src)
    (src / "adapter_config.json").write_text("{}")
    return src, {"files": {"adapter_config.json": hashlib.sha256(b"{}").hexdigest(), NAME: WANT}}


def test_a_packed_file_hashes_and_copies_out_as_its_own_bytes(tmp_path):
    p = _packed_file(tmp_path)
    assert p.name == NAME + ".xz" and p.stat().st_size < len(DATA) // 2 and p.stat().st_mode & 0o777 == 0o644
    assert packed.sha256_of(p) == WANT and packed.matching(tmp_path, NAME, WANT) == p
    out = tmp_path / "out" / NAME
    packed.copy_out(p, out)
    assert out.read_bytes() == DATA and out.stat().st_mode & 0o777 == 0o644
    assert sorted(x.name for x in out.parent.iterdir()) == [NAME]  # no temporary left


def test_the_copy_that_matches_is_found_whichever_it_is(tmp_path):
    p = _packed_file(tmp_path)
    (tmp_path / NAME).write_bytes(b"a stale copy")  # beside a good pack: the pack is the one
    assert packed.matching(tmp_path, NAME, WANT) == p
    assert packed.matching(tmp_path, NAME, hashlib.sha256(b"a stale copy").hexdigest()) == tmp_path / NAME
    assert packed.matching(tmp_path, "other", WANT) is None


def test_a_damaged_pack_matches_nothing_and_copies_nothing_out(tmp_path):
    p = _packed_file(tmp_path)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    assert packed.sha256_of(p) is None and packed.matching(tmp_path, NAME, WANT) is None
    p.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")  # not xz at all
    assert packed.sha256_of(p) is None
    out = tmp_path / "out" / NAME
    with pytest.raises(Exception):  # noqa: B017 - lzma's own error for bytes that are not xz
        packed.copy_out(p, out)
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_a_committed_adapter_is_copied_out_whole_and_unpacked(tmp_path):
    src, entry = _adapter(tmp_path)
    to = tmp_path / "cache" / "docqa"
    to.mkdir(parents=True)
    (to / "stale").write_text("from an earlier build")
    real._copy_out(src, entry, to)
    assert sorted(x.name for x in to.iterdir()) == ["adapter_config.json", NAME] and (to / NAME).read_bytes() == DATA
    assert real._files_entry(to.parent, "docqa", NAME)["files"] == entry["files"]


def test_a_tier_built_where_it_is_committed_is_unpacked_beside_its_packs(tmp_path):
    """The repository's own zoo/real as the build's output: its adapters must load from there."""
    src, entry = _adapter(tmp_path)
    (src / NAME).write_bytes(b"a stale copy")
    real._copy_out(src, entry, src)
    assert (src / NAME).read_bytes() == DATA and (src / (NAME + ".xz")).is_file()
    assert real._files_entry(src.parent, "docqa", NAME)["files"] == entry["files"]  # the packs are not listed


def test_a_damaged_committed_adapter_is_an_error_not_an_hour_of_training(tmp_path):
    src, entry = _adapter(tmp_path)
    pack = src / (NAME + ".xz")
    pack.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])
    with pytest.raises(CheckpointNotFoundError, match="does not match its manifest.*--force"):
        real._copy_out(src, entry, tmp_path / "cache" / "docqa")
    assert not (tmp_path / "cache" / "docqa").exists()


def test_the_committed_real_tier_holds_its_adapters_packed_and_intact():
    """Every fine-tune the committed manifest names is there, packed, with the bytes it hashes; no
    unpacked weights are tracked (they would travel with every GPU call)."""
    tier = REPO_ZOO / real.TIER
    manifest = json.loads((tier / "manifest.json").read_text())
    for ft in real.FINE_TUNES:
        files = manifest["models"][ft.name]["files"]
        found = {name: packed.matching(tier / ft.name, name, want) for name, want in files.items()}
        assert None not in found.values() and (tier / ft.name / (NAME + ".xz")).is_file(), ft.name
    tracked = subprocess.run(["git", "ls-files", str(tier)], cwd=tier, capture_output=True, text=True).stdout.split()
    if tracked:  # a checkout (an installed package has no git)
        assert not [t for t in tracked if t.endswith(".safetensors")]
