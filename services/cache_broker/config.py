"""Cache-broker configuration (flags / DM_CACHE_BROKER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os

from shared.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """Indexes cache-availability events and answers lookups."""

    nats_url: str = dataclasses.field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL"})
    ttl_factor: float = dataclasses.field(default=3.0, metadata={"help": "missed heartbeats before a sender is dead"})
    expire_every_s: float = dataclasses.field(default=0.5, metadata={"help": "how often dead senders are swept"})
    broker_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: broker-pid)"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug|info|warning|error"})

    def __post_init__(self) -> None:
        if self.ttl_factor < 1:
            raise ConfigError("ttl_factor must be >= 1")
        if self.expire_every_s <= 0:
            raise ConfigError("expire_every_s must be positive")
        if not self.broker_id:
            object.__setattr__(self, "broker_id", f"broker-{os.getpid()}")
