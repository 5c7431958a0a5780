"""Content addresses of token sequences, torch-free (the broker imports this, never torch).

A context is named by its token ids and its scope, so a sender, a broker and a receiver that saw
the same tokens in the same scope agree on its id without talking to each other.

Scope: who may reuse a context. `public` (every request) is what an operator publishes for all;
a gateway request's scope is its key's tenant (`tenant:<name>`); a direct mesh client may name
its own (a cache salt). A request finds cached contexts of its own scope and public ones only.
The scope seeds the hashes (the id here, the broker's block keys), so equal tokens in two scopes
are two contexts: two store entries, two index entries, never one found for the other. `public`
seeds nothing, so its ids are the plain content hashes.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import re

import xxhash

from droidmesh.shared.errors import BadRequestError

PUBLIC = "public"
MAX_SCOPE_CHARS = 128
# Strict on purpose: a scope rides every message and seeds hashes; no spaces, no separators NATS or
# logs treat specially, nothing empty. \Z, not $: "$" would let a trailing newline through.
SCOPE_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_SCOPE_CHARS - 1}}}\Z"
_SCOPE = re.compile(SCOPE_PATTERN)


def check_scope(scope: str) -> str:
    """`scope` if well-formed, else `BadRequestError` naming the rule (the value is not repeated)."""
    if not isinstance(scope, str) or not _SCOPE.fullmatch(scope):
        raise BadRequestError(f"a scope is 1..{MAX_SCOPE_CHARS} characters of A-Z a-z 0-9 . _ : - starting with a letter "
                         "or digit")
    return scope


def tenant_scope(tenant: str, secret: bytes = b"") -> str:
    """The scope of a gateway tenant's requests: `tenant:<name>.<32 hex>`, the hex an HMAC of the
    name under the key file's scope secret, so a direct mesh client that knows a tenant's name
    still cannot name its scope (and so cannot reuse, look up or time its contexts). Without a
    secret (an older key file) the name alone, which the gateway warns about."""
    if not secret:
        return f"tenant:{tenant}"
    return f"tenant:{tenant}.{hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]}"


CALLER_SCOPE_PREFIX = "user:"


def caller_scope(user: str) -> str:
    """The private scope of NATS user `user`: `user:<name>`; "" (a server without users, where
    nobody can be told apart) is `user:anonymous`, one scope for every anonymous caller."""
    return check_scope(f"{CALLER_SCOPE_PREFIX}{user or 'anonymous'}")


def scope_seed(scope: str) -> int:
    """The xxh3 seed a scope's hashes use: 0 (no seed) for `public`."""
    return 0 if scope == PUBLIC else xxhash.xxh3_64_intdigest(b"droidmesh-scope\0" + scope.encode())


def context_id(token_ids: tuple[int, ...] | list[int], scope: str = PUBLIC) -> str:
    """Content address of a context: xxh3-128 of its token ids as little-endian uint32, seeded by its scope."""
    arr = array.array("I", token_ids)
    return xxhash.xxh3_128_hexdigest(arr.tobytes(), seed=scope_seed(scope))


def held_context_id(token_ids: tuple[int, ...] | list[int], scope: str, model_sha256: str) -> str:
    """Content address of a context a receiver holds from its own prefill: as `context_id`, with
    the model's weights hash hashed in, so one holder of several models (a base and its adapters)
    keeps their caches of the same tokens apart."""
    arr = array.array("I", token_ids)
    return xxhash.xxh3_128_hexdigest(arr.tobytes() + b"\0" + model_sha256.encode(), seed=scope_seed(scope))


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix of two token-id sequences (a binary search over slice
    comparisons, which run in C: a 32K-token prompt against a held context costs microseconds)."""
    x, y = tuple(a), tuple(b)
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:  # invariant: x[:lo] == y[:lo], and the common prefix is at most hi
        mid = (lo + hi + 1) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
