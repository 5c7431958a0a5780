"""Per-client fairness: how many requests one client may have in flight at once (429 above).

A client is its peer address plus the API key it presents (`Authorization`), so tenants behind
one proxy or NAT each get their own share. These limits apply before a key is checked (and
without a key file nothing checks one), so a host could invent keys to multiply its share: a
second limit, on the peer address alone, bounds what any one host holds however many keys it
sends. A verified key's own quotas are `shared.auth.quota`'s. An IPv6 peer counts as its /64 (what one host is usually
given), so a host cannot multiply itself over its own addresses either. Peer addresses are the
socket's (never a forwarded header a client could write). Keys are kept only as a short digest,
never logged.

In-flight requests are counted from when the middleware admits them to when their response is
done (a stream: its last byte), so a client's streams count for as long as they run.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
from collections.abc import Iterator

from droidmesh.services.gateway import openai


def peer_of(remote: str | None) -> str:
    """The peer a request counts against: its IPv4 address, or its IPv6 /64."""
    if not remote:
        return "?"
    try:
        ip = ipaddress.ip_address(remote)
    except ValueError:  # a Unix socket's path, or nothing aiohttp could parse
        return remote[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def key_digest(authorization: str) -> str:
    """A short digest of the presented credential ("" without one)."""
    return hashlib.blake2b(authorization.encode(), digest_size=8).hexdigest() if authorization else ""


class ClientLimits:
    """Requests in flight per (peer, key) and per peer; 0 turns a limit off."""

    def __init__(self, per_client: int, per_peer: int) -> None:
        self.per_client, self.per_peer = per_client, per_peer
        self._clients: dict[tuple[str, str], int] = {}
        self._peers: dict[str, int] = {}

    def inflight(self, peer: str, key: str = "") -> tuple[int, int]:
        """(this client's requests in flight, this peer's)."""
        return self._clients.get((peer, key), 0), self._peers.get(peer, 0)

    @contextlib.contextmanager
    def admit(self, peer: str, key: str) -> Iterator[None]:
        """Count one request of (peer, key) while the block runs; `RateLimitedError` (429) when
        either limit is reached already."""
        client, at_peer = self.inflight(peer, key)
        if self.per_client and client >= self.per_client:
            raise openai.RateLimitedError(f"this client already has {client} requests in flight (the limit); "
                                          "retry when one finishes")
        if self.per_peer and at_peer >= self.per_peer:
            raise openai.RateLimitedError(f"this address already has {at_peer} requests in flight (the limit); "
                                          "retry when one finishes")
        self._clients[(peer, key)] = client + 1
        self._peers[peer] = at_peer + 1
        try:
            yield
        finally:
            _down(self._clients, (peer, key))
            _down(self._peers, peer)


def _down(counts: dict, key: object) -> None:
    """One less; a count reaching 0 is dropped, so the maps hold only clients with requests in flight."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]
