"""Committed weights kept packed (`shared/zoo/packed.py`) and the real tier's adapters read through
it (`shared/zoo/real.py`): the bytes a tier is built from are the bytes its manifest hashes."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from droidmesh.shared.zoo import packed, real
from droidmesh.shared.zoo.manifest import REPO_ZOO

DATA = bytes(range(256)) * 4096 + b"\x00" * (1 << 20)  # 2 MiB, half of it runs of one byte


def _packed_file(tmp_path: Path, name: str = "w.safetensors") -> Path:
    (tmp_path / name).write_bytes(DATA)
    (tmp_path / name).chmod(0o644)
    return packed.pack(tmp_path / name)


def test_a_packed_file_hashes_and_copies_out_as_its_own_bytes(tmp_path):
    p = _packed_file(tmp_path)
    assert p.name == "w.safetensors.xz" and not (tmp_path / "w.safetensors").exists()
    assert p.stat().st_size < len(DATA) // 2
    assert packed.sha256(tmp_path, "w.safetensors") == hashlib.sha256(DATA).hexdigest()
    out = tmp_path / "out" / "w.safetensors"
    packed.copy_out(tmp_path, "w.safetensors", out)
    assert out.read_bytes() == DATA and out.stat().st_mode & 0o777 == 0o644
    assert sorted(x.name for x in out.parent.iterdir()) == ["w.safetensors"]  # no temporary left


def test_a_file_as_it_is_wins_over_its_packed_one_and_a_missing_one_has_no_hash(tmp_path):
    _packed_file(tmp_path)
    (tmp_path / "w.safetensors").write_bytes(b"refreshed")
    assert packed.sha256(tmp_path, "w.safetensors") == hashlib.sha256(b"refreshed").hexdigest()
    assert packed.sha256(tmp_path, "other") is None
    with pytest.raises(FileNotFoundError):
        packed.copy_out(tmp_path, "other", tmp_path / "x")


def test_a_truncated_packed_file_has_no_hash_and_copies_nothing_out(tmp_path):
    p = _packed_file(tmp_path)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    assert packed.sha256(tmp_path, "w.safetensors") is None
    out = tmp_path / "out" / "w.safetensors"
    with pytest.raises(EOFError):
        packed.copy_out(tmp_path, "w.safetensors", out)
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_an_adapter_is_intact_packed_and_copied_out_whole(tmp_path):
    src = tmp_path / "docqa"
    src.mkdir()
    (src / "adapter_config.json").write_text("{}")
    (src / "adapter_model.safetensors").write_bytes(DATA)
    entry = {"files": {"adapter_config.json": hashlib.sha256(b"{}").hexdigest(),
                       "adapter_model.safetensors": hashlib.sha256(DATA).hexdigest()}}
    packed.pack(src / "adapter_model.safetensors")
    assert real._intact(src, entry)
    to = tmp_path / "cache" / "docqa"
    to.mkdir(parents=True)
    (to / "stale").write_text("from an earlier build")
    real._copy_out(src, entry, to)
    assert sorted(x.name for x in to.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert real._files_entry(tmp_path, "docqa", "adapter_model.safetensors")["files"] == entry["files"]  # names unpacked
    assert not real._intact(src, {"files": {**entry["files"], "adapter_model.safetensors": "0" * 64}})


def test_the_committed_real_tier_holds_its_adapters_packed_and_intact():
    """Every fine-tune the committed manifest names is there, packed, with the bytes it hashes; no
    unpacked weights are tracked (they would travel with every GPU call)."""
    tier = REPO_ZOO / real.TIER
    manifest = json.loads((tier / "manifest.json").read_text())
    for ft in real.FINE_TUNES:
        assert (tier / ft.name / "adapter_model.safetensors.xz").is_file()
        assert real._intact(tier / ft.name, manifest["models"][ft.name]), ft.name
    tracked = subprocess.run(["git", "ls-files", str(tier)], cwd=tier, capture_output=True, text=True).stdout.split()
    if tracked:  # a checkout (an installed package has no git)
        assert not [t for t in tracked if t.endswith(".safetensors")]
