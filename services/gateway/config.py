"""Gateway configuration (flags / DM_GATEWAY_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os

from droidmesh.shared.auth import keys as api_keys
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service.settings import BusSettings
from droidmesh.shared.wire.schemas import MAX_MESSAGE_BYTES

# A request body becomes one GenerateRequest on the bus: keep room for the envelope under
# NATS' max payload, so an accepted body never fails later as an oversize message.
MAX_BODY_CEILING = MAX_MESSAGE_BYTES - (64 << 10)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatewayConfig(BusSettings):
    """OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) over the mesh."""

    http_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address the API listens on"})
    http_port: int = dataclasses.field(default=8000, metadata={"help": "API port (0: any free port, logged)"})
    request_timeout_s: float = dataclasses.field(
        default=60.0, metadata={"help": "per-request deadline (a client may lower it: header x-request-timeout)"})
    max_body_bytes: int = dataclasses.field(default=512 << 10, metadata={"help": "largest request body accepted (413 above)"})
    default_max_tokens: int = dataclasses.field(default=16, metadata={"help": "max_tokens when a request names none"})
    max_tokens_limit: int = dataclasses.field(default=1024, metadata={"help": "largest max_tokens accepted (400 above)"})
    models_ttl_s: float = dataclasses.field(default=5.0, metadata={"help": "how long a receiver discovery is reused"})
    discovery_window_s: float = dataclasses.field(default=0.25, metadata={"help": "how long a discovery collects answers"})
    miss_window_s: float = dataclasses.field(default=1.0, metadata={
        "help": "how long the one fresh discovery a request naming an unlisted model triggers collects answers "
                "(longer than discovery_window_s: a 404 should not come from a receiver busy for a quarter second)"})
    models_keep_s: float = dataclasses.field(default=30.0, metadata={
        "help": "how long a model stays listed after the last discovery that found it: a receiver too busy to answer "
                "one discovery in its window is not gone (one whose receivers are gone answers 503 meanwhile)"})
    shutdown_grace_s: float = dataclasses.field(default=30.0, metadata={"help": "how long a stop waits for requests in flight"})
    header_timeout_s: float = dataclasses.field(default=10.0, metadata={
        "help": "how long a connection may take to send a complete request head, from its start or its previous "
                "response (idle keep-alive connections close after it too)"})
    body_timeout_s: float = dataclasses.field(default=30.0, metadata={"help": "how long reading a request body may take (408 after)"})
    max_connections: int = dataclasses.field(default=512, metadata={
        "help": "open client connections at once (kept below the descriptor limit): at the cap the longest-idle "
                "connection is closed for a new one, or the new one gets a 503 when all have requests in flight"})
    max_inflight_per_client: int = dataclasses.field(default=8, metadata={
        "help": "requests one client (peer address + API key) may have in flight (429 above; 0: no limit)"})
    max_inflight_per_peer: int = dataclasses.field(default=32, metadata={
        "help": "requests one peer address may have in flight whatever keys it sends (429 above; 0: no limit)"})
    api_keys: str = dataclasses.field(default="", metadata={
        "help": "file of API keys (`droidmesh keys add`; a mounted secret works the same): every /v1 request then "
                "needs one. Without it the API binds loopback only"})
    keys_reload_s: float = dataclasses.field(default=1.0, metadata={
        "help": "how often the key file is checked for changes, read again without a restart (a file that does not "
                "load keeps the keys before it; 0: read at start only)"})
    quota_lease_fraction: float = dataclasses.field(default=0.05, metadata={
        "help": "share of a key's per-minute limits a replica takes from the rate buckets it shares with the other "
                "replicas through NATS at once (at least one request; larger: fewer NATS round trips)"})
    quota_lease_s: float = dataclasses.field(default=1.0, metadata={
        "help": "how long a replica keeps the unspent share it took before giving it back (what the other replicas "
                "may miss of a key's limits, at most)"})
    quota_timeout_s: float = dataclasses.field(default=0.5, metadata={
        "help": "deadline of each call to the shared rate buckets; past it the replica enforces its keys' limits on "
                "its own until NATS answers again"})
    gateway_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: gateway-pid)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port {self.http_port} out of range")
        if not self.http_host:
            raise ConfigError("http_host must not be empty")
        for name in ("request_timeout_s", "models_ttl_s", "discovery_window_s", "miss_window_s", "models_keep_s", "shutdown_grace_s",
                     "header_timeout_s", "body_timeout_s", "quota_lease_s", "quota_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be positive")
        if not 0 < self.quota_lease_fraction <= 1:
            raise ConfigError("quota_lease_fraction must be in (0, 1]")
        if not 0 <= self.keys_reload_s < float("inf"):
            raise ConfigError("keys_reload_s must be >= 0 (0: read at start only)")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be >= 1")
        for name in ("max_inflight_per_client", "max_inflight_per_peer"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: no limit)")
        if not 1 <= self.max_body_bytes <= MAX_BODY_CEILING:
            raise ConfigError(f"max_body_bytes must be in [1, {MAX_BODY_CEILING}] (one bus message)")
        if self.max_tokens_limit < 1:
            raise ConfigError("max_tokens_limit must be >= 1")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("default_max_tokens must be in [1, max_tokens_limit]")
        if self.api_keys:
            api_keys.load(self.api_keys)  # a missing or malformed file stops the start here, in one line
        elif not _loopback(self.http_host):
            raise ConfigError(f"refusing to listen on {self.http_host} without API keys: anyone reaching it would use "
                              "every model with no quota; set api_keys (DM_GATEWAY_API_KEYS, `droidmesh keys add` makes "
                              "the file) or bind 127.0.0.1")
        if not self.gateway_id:
            object.__setattr__(self, "gateway_id", f"gateway-{os.getpid()}")


def _loopback(host: str) -> bool:
    """Whether `host` names only this machine (a name other than localhost may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
