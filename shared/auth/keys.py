"""API keys: the file that holds them (hashed), making one, and checking a presented one.

A key is `dmk_<id>_<secret>`: `id` (12 hex digits) names it in the file, in logs and in
metrics; `secret` is 32 random bytes (urlsafe base64). The file keeps only `sha256(key)`.

Why sha256 and not scrypt / argon2: slow hashes exist to protect low-entropy passwords from
offline guessing. These keys carry 256 random bits, so a leaked hash cannot be inverted by any
amount of guessing, and a slow hash would only cost every request (and every forged request an
attacker sends) tens of milliseconds of CPU. Comparison is `hmac.compare_digest`, and a key whose
id is unknown is compared against a dummy digest, so the time a refusal takes does not tell
whether an id exists.

The file is TOML: `scope_secret` (64 hex digits, made with the file) and one `[[key]]` table per
key, read at start and again whenever it changes (`KeyFile`: a k8s Secret mounted as a file works
the same; a file that no longer loads keeps the keys loaded before). A tenant's cache scope
is an HMAC of its name under `scope_secret` (`hashing.tenant_scope`): whoever lacks the file
cannot name a tenant's scope. Every value is checked: an entry with an unknown field, a bad name,
a non-positive limit or a duplicate id stops the gateway with one line naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import tomllib
from pathlib import Path

import structlog

from droidmesh.shared.errors import AuthenticationError, ConfigError
from droidmesh.shared.wire.hashing import tenant_scope

log = structlog.get_logger("keys")
KEY = re.compile(r"dmk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # tenants and model ids as the file may name them
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
SECRET = re.compile(r"[0-9a-f]{64}")
ANY_MODEL = "*"
MAX_KEYS = 10_000  # bounds the metrics' key_id label and the file read at start
MAX_FILE_BYTES = 4 << 20
MAX_LIMIT = 10**9
_DUMMY = "sha256:" + "0" * 64


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """One key's entry: who it is (tenant), what it may use and spend. Limits are per key."""

    id: str
    digest: str  # "sha256:<hex>" of the whole key string
    tenant: str
    models: tuple[str, ...]  # ("*",): every model
    requests_per_minute: int
    tokens_per_minute: int  # prompt + completion tokens
    max_concurrent: int
    scope: str = ""  # the tenant's cache scope (set by `load` from the file's scope secret)

    def allows(self, model: str) -> bool:
        return ANY_MODEL in self.models or model in self.models


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def make_key() -> tuple[str, str]:
    """(a fresh key, its id)."""
    kid = secrets.token_hex(6)
    return f"dmk_{kid}_{secrets.token_urlsafe(32)}", kid


def _entry(raw: object, where: str) -> ApiKey:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a [[key]] table expected")
    fields = {f.name for f in dataclasses.fields(ApiKey)} - {"digest", "scope"} | {"hash"}
    unknown = set(raw) - fields
    missing = fields - set(raw)
    if unknown or missing:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    kid, hashed, tenant, models = raw["id"], raw["hash"], raw["tenant"], raw["models"]
    if not (isinstance(kid, str) and re.fullmatch(r"[0-9a-f]{12}", kid)):
        raise ConfigError(f"{where}: id must be 12 hex digits")
    if not (isinstance(hashed, str) and DIGEST.fullmatch(hashed)):
        raise ConfigError(f"{where} (key {kid}): hash must be sha256:<64 hex digits>")
    if not (isinstance(tenant, str) and NAME.fullmatch(tenant)):
        raise ConfigError(f"{where} (key {kid}): tenant must match {NAME.pattern}")
    if not (isinstance(models, list) and 1 <= len(models) <= 256
            and all(isinstance(m, str) and (m == ANY_MODEL or NAME.fullmatch(m)) for m in models)):
        raise ConfigError(f"{where} (key {kid}): models must be 1..256 model ids or \"*\"")
    limits = {}
    for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        value = raw[name]
        if not (type(value) is int and 1 <= value <= MAX_LIMIT):
            raise ConfigError(f"{where} (key {kid}): {name} must be an integer in [1, {MAX_LIMIT}]")
        limits[name] = value
    return ApiKey(id=kid, digest=hashed, tenant=tenant, models=tuple(models),
                  requests_per_minute=limits["requests_per_minute"], tokens_per_minute=limits["tokens_per_minute"],
                  max_concurrent=limits["max_concurrent"])


def load(path: str | Path) -> dict[str, ApiKey]:
    """The key file's entries by id; `ConfigError` naming the first thing wrong with it."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"key file {p}: {size} bytes, over {MAX_FILE_BYTES}")
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"key file {p}: {e}") from None
    if set(doc) - {"key", "scope_secret"} or not isinstance(doc.get("key", []), list):
        raise ConfigError(f"key file {p}: only scope_secret and [[key]] tables are allowed")
    secret = doc.get("scope_secret", "")
    if not (isinstance(secret, str) and (secret == "" or SECRET.fullmatch(secret))):
        raise ConfigError(f"key file {p}: scope_secret must be 64 hex digits")
    entries = doc.get("key", [])
    if len(entries) > MAX_KEYS:
        raise ConfigError(f"key file {p}: {len(entries)} keys, at most {MAX_KEYS}")
    keys: dict[str, ApiKey] = {}
    for i, raw in enumerate(entries):
        k = _entry(raw, f"key file {p}, entry {i + 1}")
        if k.id in keys:
            raise ConfigError(f"key file {p}: id {k.id} appears twice")
        keys[k.id] = dataclasses.replace(k, scope=tenant_scope(k.tenant, bytes.fromhex(secret)))
    return keys


def has_scope_secret(path: str | Path) -> bool:
    """Whether the (loadable) key file has a scope secret: without one a tenant's scope is its name."""
    return "scope_secret" in tomllib.loads(Path(path).read_text(encoding="utf-8"))


def render(k: ApiKey) -> str:
    """`k` as one [[key]] table (every value was checked against a plain charset: no escaping)."""
    models = ", ".join(f'"{m}"' for m in k.models)
    return (f'[[key]]\nid = "{k.id}"\nhash = "{k.digest}"\ntenant = "{k.tenant}"\nmodels = [{models}]\n'
            f"requests_per_minute = {k.requests_per_minute}\ntokens_per_minute = {k.tokens_per_minute}\n"
            f"max_concurrent = {k.max_concurrent}\n\n")


def append(path: str | Path, k: ApiKey) -> None:
    """Add `k` to the key file (made owner-only if new), after checking the result still loads."""
    p = Path(path)
    if p.exists():
        load(p)  # refuse to append to a file the gateway would refuse anyway
    new = not p.exists()
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if new:  # the file's scope secret, made with it: TOML wants top-level keys before any table
            f.write(f'scope_secret = "{secrets.token_hex(32)}"\n\n')
        f.write(render(k))
    load(p)


class KeyRing:
    """The loaded keys; `authenticate` turns an `Authorization` header into its key's entry."""

    def __init__(self, keys: dict[str, ApiKey]):
        self.keys = keys

    def authenticate(self, authorization: str) -> ApiKey:
        """The entry of the key in `Bearer <key>`; `AuthenticationError` for none, a malformed or a
        wrong one. The message never repeats what was presented."""
        scheme, _, presented = authorization.strip().partition(" ")
        if not authorization:
            raise AuthenticationError("no API key: send it as the header 'Authorization: Bearer <key>'")
        presented = presented.strip()
        m = KEY.fullmatch(presented) if scheme.lower() == "bearer" else None
        entry = self.keys.get(m.group(1)) if m else None
        # Always one digest and one comparison, so a refusal takes as long for a known id as an unknown one.
        ok = hmac.compare_digest(digest(presented if m else ""), entry.digest if entry else _DUMMY)
        if entry is None or not ok:
            raise AuthenticationError("incorrect API key provided")
        return entry


class KeyFile:
    """The key file as last loaded (`keys`), re-read by `poll` when it has changed (its mtime, size
    or inode: a k8s Secret is swapped in by a rename). A change that does not load keeps the keys
    loaded before and is logged once, in one line naming what is wrong; the next change is read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen = self._signature()
        self.keys = load(self.path)  # at start a bad file stops the gateway (the config checked it first)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def poll(self) -> dict[str, ApiKey] | None:
        """The file's keys when it changed since the last look and loads; else None."""
        seen = self._signature()
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            keys = load(self.path)
        except ConfigError as e:
            log.warning("key_file_refused", error=str(e), keys=len(self.keys), effect="the keys loaded before stay in use")
            return None
        old = self.keys
        log.info("key_file_reloaded", keys=len(keys), added=len(keys.keys() - old.keys()),
                 removed=len(old.keys() - keys.keys()), changed=sum(1 for k, v in keys.items() if k in old and old[k] != v))
        self.keys = keys
        return keys
