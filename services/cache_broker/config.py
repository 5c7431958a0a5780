"""Cache-broker configuration (flags / DM_CACHE_BROKER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service.settings import BusSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerConfig(BusSettings):
    """Indexes cache-availability events and answers lookups."""

    ttl_factor: float = dataclasses.field(default=3.0, metadata={"help": "missed heartbeats before a sender is dead"})
    expire_every_s: float = dataclasses.field(default=0.5, metadata={"help": "how often dead senders are swept"})
    broker_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: broker-pid)"})
    max_senders: int = dataclasses.field(default=1024, metadata={"help": "senders tracked at most (more are refused)"})
    max_contexts_per_sender: int = dataclasses.field(default=4096, metadata={"help": "contexts indexed per sender at most"})
    max_heartbeat_s: float = dataclasses.field(
        default=30.0, metadata={"help": "longest heartbeat interval a sender may declare (longer is clamped)"})
    max_holder_age_s: float = dataclasses.field(
        default=900.0, metadata={"help": "a holder neither re-announced nor listed in a heartbeat for this long is dropped"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttl_factor < 1:
            raise ConfigError("ttl_factor must be >= 1")
        if self.expire_every_s <= 0:
            raise ConfigError("expire_every_s must be positive")
        if self.max_senders < 1 or self.max_contexts_per_sender < 1:
            raise ConfigError("max_senders and max_contexts_per_sender must be >= 1")
        if self.max_heartbeat_s <= 0 or self.max_holder_age_s <= 0:
            raise ConfigError("max_heartbeat_s and max_holder_age_s must be positive")
        if not self.broker_id:
            object.__setattr__(self, "broker_id", f"broker-{os.getpid()}")
