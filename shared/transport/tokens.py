"""Pull grants: single-use, short-lived capabilities for one pull of one context, HMAC-signed.

A receiver asks the holder's sender for a grant just before it pulls (`GrantRequest` on
`subjects.sender_grant(sender_id)`, `shared/transport/pull.py::request_grant`); the reply goes to
that receiver's own inbox, which NATS lets no other user read (per-user inbox prefixes), and only
the receiver role may ask. A grant names the context, an expiry a few seconds ahead and a random
nonce, signed with the sender's key (which never leaves the sender): it cannot be forged or moved
to another context, and the sender accepts each nonce once. Nothing else carries a grant
(availability events and lookup replies name none), so a leaked event, lookup reply or used
grant is worthless, and an unused one lapses within seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from droidmesh.shared.errors import OverloadedError, UnauthorizedError

MAX_OUTSTANDING = 65536  # unused, unexpired grants a sender keeps; more asks are refused as overload


class TokenIssuer:
    """Called on the sender's event loop (`issue` by the grant handler, `verify` by the bulk
    server before it serves a pull); neither blocks."""

    def __init__(self, ttl_s: float, key: bytes | None = None, clock=time.time, max_outstanding: int = MAX_OUTSTANDING):
        self.ttl_s = ttl_s
        self._key = key or secrets.token_bytes(32)
        self._clock = clock
        self._max = max_outstanding
        self._live: dict[str, tuple[float, str]] = {}  # nonce -> (expiry, grantee), issued and not used yet

    def _mac(self, context_id: str, expires_ms: int, nonce: str) -> str:
        return hmac.new(self._key, f"{context_id}|{expires_ms}|{nonce}".encode(), hashlib.sha256).hexdigest()

    def issue(self, context_id: str, grantee: str = "") -> tuple[str, float]:
        """(grant, expiry as unix seconds) for one pull of `context_id` by `grantee` (the NATS user
        that asked, whom the grant's reply reached; "" where users are unknown): `verify` returns
        it, so the bulk server knows whose connection a pull proves (its slots are capped per
        grantee)."""
        now = self._clock()
        self._prune(now)
        if len(self._live) >= self._max:
            raise OverloadedError(f"{len(self._live)} pull grants outstanding; try again")
        expires_ms, nonce = int((now + self.ttl_s) * 1000), secrets.token_hex(12)
        self._live[nonce] = (expires_ms / 1000, grantee)
        return f"{expires_ms}.{nonce}.{self._mac(context_id, expires_ms, nonce)}", expires_ms / 1000

    def verify(self, context_id: str, token: str) -> str:
        """The grantee of `token` if it is an unused, unexpired grant for `context_id` from this
        issuer (it is then used up); else `UnauthorizedError`."""
        if not token:
            raise UnauthorizedError("pull without a grant")
        expires_s, _, rest = token.partition(".")
        nonce, _, mac = rest.partition(".")
        try:
            expires_ms = int(expires_s)
        except ValueError:
            raise UnauthorizedError("malformed grant") from None
        if not hmac.compare_digest(mac, self._mac(context_id, expires_ms, nonce)):
            raise UnauthorizedError(f"grant not valid for context {context_id}")
        now = self._clock()
        if now > expires_ms / 1000:
            raise UnauthorizedError(f"grant expired {now - expires_ms / 1000:.1f}s ago")
        live = self._live.pop(nonce, None)
        if live is None:
            raise UnauthorizedError("grant already used")
        return live[1]

    def _prune(self, now: float) -> None:
        if len(self._live) >= self._max // 2:
            self._live = {n: e for n, e in self._live.items() if e[0] >= now}
