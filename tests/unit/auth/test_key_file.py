"""The key file read again when it changes (`KeyFile.poll`): a good file switches, a bad one keeps
the keys before it (one log line, once), an unchanged one is not read again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from droidmesh.shared.auth import keys
from droidmesh.shared.errors import ConfigError

SECRET = "ab" * 32


def write(path: Path, entries: list[keys.ApiKey], extra: str = "") -> None:
    """The file with `entries`, its mtime moved on (a rewrite within one clock tick still counts)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(f'scope_secret = "{SECRET}"\n\n' + "".join(keys.render(e) for e in entries) + extra)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def fresh(tenant: str = "acme", **kw: int) -> tuple[str, keys.ApiKey]:
    key, kid = keys.make_key()
    limits = {"requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 4, **kw}
    return key, keys.ApiKey(id=kid, digest=keys.digest(key), tenant=tenant, models=("qa",), **limits)


def test_a_changed_file_switches_and_an_unchanged_one_is_not_read(tmp_path):
    path = tmp_path / "keys.toml"
    (_, a), (_, b) = fresh(), fresh("beta")
    write(path, [a])
    kf = keys.KeyFile(path)
    assert set(kf.keys) == {a.id} and kf.poll() is None
    write(path, [b])
    with structlog.testing.capture_logs() as logs:
        got = kf.poll()
    assert got is not None and set(got) == {b.id} and kf.keys is got and kf.poll() is None
    (line,) = [e for e in logs if e["event"] == "key_file_reloaded"]
    assert (line["keys"], line["added"], line["removed"], line["changed"]) == (1, 1, 1, 0)


def test_a_bad_file_keeps_the_keys_before_it_and_says_so_once(tmp_path):
    path = tmp_path / "keys.toml"
    secret_key, a = fresh()
    write(path, [a])
    kf = keys.KeyFile(path)
    write(path, [a], extra="[[key]]\nid = \"nothex\"\n")
    with structlog.testing.capture_logs() as logs:
        assert kf.poll() is None and kf.poll() is None  # the second look finds no change: no second line
    (line,) = [e for e in logs if e["event"] == "key_file_refused"]
    assert "entry 2" in line["error"] and set(kf.keys) == {a.id} and secret_key not in repr(logs)
    path.unlink()  # gone (a Secret being swapped): the keys stay too
    assert kf.poll() is None and set(kf.keys) == {a.id}
    _, b = fresh()
    write(path, [a, b])  # the next good file is read
    got = kf.poll()
    assert got is not None and set(got) == {a.id, b.id}


def test_a_limit_change_is_a_change(tmp_path):
    path = tmp_path / "keys.toml"
    _, a = fresh()
    write(path, [a])
    kf = keys.KeyFile(path)
    slower = keys.ApiKey(**{**a.__dict__, "requests_per_minute": 1, "scope": ""})
    write(path, [slower])
    got = kf.poll()
    assert got is not None and got[a.id].requests_per_minute == 1


def test_a_bad_file_at_start_still_stops_the_gateway(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="only scope_secret"):
        keys.KeyFile(path)
