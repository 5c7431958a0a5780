"""Cache-broker configuration (flags / DM_CACHE_BROKER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import math
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
    # Bytes and work per sender and per event: counts alone let one login hold gigabytes and the loop.
    max_indexed_blocks: int = dataclasses.field(
        default=256, metadata={"help": "16-token blocks keyed per context (and hashed per lookup); longer shared "
                                       "prefixes are measured token by token"})
    max_sender_index_bytes: int = dataclasses.field(
        default=64 << 20, metadata={"help": "index bytes one sender's holders may take (its oldest go first)"})
    max_index_bytes: int = dataclasses.field(
        default=1 << 30, metadata={"help": "index bytes of every sender together (new holders refused beyond)"})
    sender_events_per_s: float = dataclasses.field(
        default=200.0, metadata={"help": "availability / eviction events a second one sender is handled at"})
    sender_event_burst: int = dataclasses.field(
        default=4096, metadata={"help": "events one sender may have handled at once (a re-announcement of everything)"})
    sender_cpu_share: float = dataclasses.field(
        default=0.25, metadata={"help": "seconds a second of the event loop one sender's events may take"})
    sender_cpu_burst_s: float = dataclasses.field(
        default=0.5, metadata={"help": "event-loop seconds one sender's events may take at once"})
    max_queued_bytes_per_sender: int = dataclasses.field(
        default=32 << 20, metadata={"help": "bytes of one sender's events waiting for its budget (more are dropped)"})
    max_queued_bytes: int = dataclasses.field(
        default=256 << 20, metadata={"help": "bytes of every sender's events waiting for their budgets"})
    sender_heartbeats_per_s: float = dataclasses.field(
        default=10.0, metadata={"help": "heartbeats a second one sender is heard at (more are dropped)"})
    over_budget_log_s: float = dataclasses.field(
        default=10.0, metadata={"help": "a sender over a budget is logged at most once this often (per reason)"})

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
        if min(self.max_indexed_blocks, self.max_sender_index_bytes, self.max_index_bytes, self.sender_event_burst,
               self.max_queued_bytes_per_sender, self.max_queued_bytes) < 1:
            raise ConfigError("max_indexed_blocks, the byte budgets and sender_event_burst must be >= 1")
        rates = (self.sender_events_per_s, self.sender_cpu_share, self.sender_cpu_burst_s, self.sender_heartbeats_per_s,
                 self.over_budget_log_s)
        if not all(math.isfinite(r) and r > 0 for r in rates):
            raise ConfigError("the per-sender rates, sender_cpu_burst_s and over_budget_log_s must be positive")
        if not self.broker_id:
            object.__setattr__(self, "broker_id", f"broker-{os.getpid()}")
