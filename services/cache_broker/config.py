"""Cache-broker configuration (flags / DM_CACHE_BROKER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.settings import BusSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerConfig(BusSettings):
    """Indexes cache-availability events and answers lookups."""

    ttl_factor: float = dataclasses.field(default=3.0, metadata={"help": "missed heartbeats before a sender is dead"})
    expire_every_s: float = dataclasses.field(default=0.5, metadata={"help": "how often dead senders are swept"})
    broker_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: broker-pid)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttl_factor < 1:
            raise ConfigError("ttl_factor must be >= 1")
        if self.expire_every_s <= 0:
            raise ConfigError("expire_every_s must be positive")
        if not self.broker_id:
            object.__setattr__(self, "broker_id", f"broker-{os.getpid()}")
