"""API keys: making one, the key file (hashed entries, strict checks) and authenticating a header."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from droidmesh.shared.auth import keys
from droidmesh.shared.errors import AuthenticationError, ConfigError
from droidmesh.shared.tools.cli.main import main


def entry(key: str, kid: str, **kw) -> keys.ApiKey:
    return keys.ApiKey(**{"id": kid, "digest": keys.digest(key), "tenant": "a", "models": ("qa",),
                          "requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 2, **kw})


def test_cli_prints_the_key_once_and_stores_only_its_hash(tmp_path):
    """`keys add` prints a key that authenticates against the file it wrote; the file holds its
    sha256, never the key, and is owner-only; `keys list` shows ids and quotas, no secret."""
    path = tmp_path / "keys.toml"
    out = CliRunner().invoke(main, ["keys", "add", "--file", str(path), "--tenant", "acme", "--models", "qa,code",
                                    "--rpm", "5", "--tpm", "500", "--concurrency", "2"])
    assert out.exit_code == 0, out.output
    key = out.stdout.strip()
    m = keys.KEY.fullmatch(key)
    assert m
    text = path.read_text()
    secret = m.group(2)  # url-safe base64: it may itself hold "_", so not key.split("_")[2]
    assert key not in text and secret not in text and keys.digest(key) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (k,) = keys.load(path).values()
    assert (k.tenant, k.models, k.requests_per_minute, k.tokens_per_minute, k.max_concurrent) == (
        "acme", ("qa", "code"), 5, 500, 2)
    assert keys.KeyRing(keys.load(path)).authenticate(f"Bearer {key}") == k
    listed = CliRunner().invoke(main, ["keys", "list", "--file", str(path)])
    assert listed.exit_code == 0 and k.id in listed.stdout and "sha256" not in listed.stdout


@pytest.mark.parametrize("header", ["", "Bearer", "Basic abc", "Bearer dmk_short", "Bearer " + "x" * 5000])
def test_missing_or_malformed_keys_are_refused(header):
    key, kid = keys.make_key()
    ring = keys.KeyRing({kid: entry(key, kid)})
    with pytest.raises(AuthenticationError) as e:
        ring.authenticate(header)
    assert "x" * 100 not in str(e.value)


def test_a_wrong_secret_or_unknown_id_is_refused_without_echoing_it():
    key, kid = keys.make_key()
    ring = keys.KeyRing({kid: entry(key, kid)})
    other, _ = keys.make_key()
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for presented in (other, forged):
        with pytest.raises(AuthenticationError) as e:
            ring.authenticate(f"Bearer {presented}")
        assert presented not in str(e.value)
    assert ring.authenticate(f"bearer  {key} ").id == kid  # scheme case and spaces as HTTP allows


@pytest.mark.parametrize("bad,fragment", [
    ('tenant = "a b"', "tenant"),
    ('models = []', "models"),
    ('requests_per_minute = 0', "requests_per_minute"),
    ('tokens_per_minute = 1.5', "tokens_per_minute"),
    ('hash = "md5:00"', "hash"),
    ('extra = 1', "unknown fields"),
])
def test_a_bad_entry_stops_loading_with_one_line(tmp_path, bad, fragment):
    key, kid = keys.make_key()
    good = keys.render(entry(key, kid))
    name = bad.split(" = ")[0]
    lines = [ln for ln in good.splitlines() if not ln.startswith(f"{name} =")] + [bad]
    (tmp_path / "k.toml").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=fragment):
        keys.load(tmp_path / "k.toml")


def test_duplicate_ids_and_missing_files_are_config_errors(tmp_path):
    key, kid = keys.make_key()
    (tmp_path / "k.toml").write_text(keys.render(entry(key, kid)) * 2)
    with pytest.raises(ConfigError, match="twice"):
        keys.load(tmp_path / "k.toml")
    with pytest.raises(ConfigError, match="key file"):
        keys.load(tmp_path / "absent.toml")


def test_a_tenants_scope_comes_from_the_files_secret_not_its_name_alone(tmp_path):
    """A file made by `append` carries a scope secret; its keys' scope is the tenant's name plus an
    HMAC under it, a valid scope that a client knowing only the name cannot form, the same for
    every key of the tenant, and another file's differs."""
    from droidmesh.shared.wire.hashing import check_scope, tenant_scope

    def make(path, tenant):
        key, kid = keys.make_key()
        keys.append(path, keys.ApiKey(id=kid, digest=keys.digest(key), tenant=tenant, models=("m",),
                                      requests_per_minute=1, tokens_per_minute=1, max_concurrent=1))

    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    make(one, "a")
    make(one, "a")
    make(two, "a")
    assert keys.has_scope_secret(one)
    scopes = {k.scope for k in keys.load(one).values()}
    assert len(scopes) == 1
    [scope] = scopes
    assert check_scope(scope) == scope and scope.startswith("tenant:a.") and scope != tenant_scope("a")
    assert {k.scope for k in keys.load(two).values()} != scopes


@pytest.mark.parametrize("secret", ['"abc"', '"' + "g" * 64 + '"', "7"])
def test_a_malformed_scope_secret_is_refused(tmp_path, secret):
    p = tmp_path / "keys.toml"
    p.write_text(f"scope_secret = {secret}\n")
    with pytest.raises(ConfigError, match="scope_secret"):
        keys.load(p)
