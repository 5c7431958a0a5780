"""Capability tokens for UCX pulls: HMAC over (context, expiry) with the sender's own key.

A sender issues a token per context with each availability event; only holders of the event
(NATS permissions decide who may read those) can pull, only that context, only until expiry.
The key never leaves the sender, so a token cannot be forged or moved to another context.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from droidmesh.shared.errors import UnauthorizedError


class TokenIssuer:
    def __init__(self, ttl_s: float, key: bytes | None = None, clock=time.time):
        self.ttl_s = ttl_s
        self._key = key or secrets.token_bytes(32)
        self._clock = clock

    def _mac(self, context_id: str, expires: int) -> str:
        return hmac.new(self._key, f"{context_id}|{expires}".encode(), hashlib.sha256).hexdigest()

    def issue(self, context_id: str) -> tuple[str, float]:
        """(token, expiry as unix seconds) for pulling `context_id`."""
        expires = int(self._clock() + self.ttl_s)
        return f"{expires}.{self._mac(context_id, expires)}", float(expires)

    def verify(self, context_id: str, token: str) -> None:
        """Raise `UnauthorizedError` unless `token` grants `context_id` now."""
        if not token:
            raise UnauthorizedError("pull without a capability token")
        expires_s, _, mac = token.partition(".")
        try:
            expires = int(expires_s)
        except ValueError:
            raise UnauthorizedError("malformed capability token") from None
        if not hmac.compare_digest(mac, self._mac(context_id, expires)):
            raise UnauthorizedError(f"capability token not valid for context {context_id}")
        if self._clock() > expires:
            raise UnauthorizedError(f"capability token expired {self._clock() - expires:.0f}s ago")
