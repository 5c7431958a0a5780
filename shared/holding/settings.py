"""Settings of the holder role (flags / env of the services that hold contexts: senders, receivers)."""

from __future__ import annotations

import dataclasses

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service.settings import BusSettings
from droidmesh.shared.transport import slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class HolderSettings(BusSettings):
    """How a service holds contexts for pulls: the store's budgets, grants, heart-beats, who may
    read, and where its bulk server listens."""

    store_bytes: int = dataclasses.field(default=2 << 30, metadata={"help": "byte budget of the KV/E store (pinned by pulls too)"})
    device_store_bytes: int = dataclasses.field(default=0, metadata={
        "help": "on a GPU, device bytes the store's contexts may take; past it the least recently used move to host "
                "memory (still served) before any is evicted (0: store_bytes bounds them alone)"})
    pull_bytes: int = dataclasses.field(default=1 << 30, metadata={
        "help": "byte budget of copies made for pulls in flight (prefix slices, CUDA staging); past it a pull is refused"})
    heartbeat_s: float = dataclasses.field(default=1.0, metadata={"help": "heartbeat interval"})
    grant_ttl_s: float = dataclasses.field(default=10.0, metadata={
        "help": "lifetime of a single-use pull grant (asked for just before each pull)"})
    readers: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "receiver models granted pulls besides the held model's own and those a pair config names "
                "(default groups, translators, explicit modes; '*': any); checked under NATS auth"})
    ucx_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address receivers reach us at"})
    ucx_port: int = dataclasses.field(default=0, metadata={"help": "UCX listener port (0: ephemeral)"})
    bulk_max_connections: int = dataclasses.field(default=slots.MAX_CONNECTIONS, metadata={
        "help": "bulk-channel connections held at once (ucx, nixl, shm); at the cap an idle one makes room"})
    bulk_peer_connections: int = dataclasses.field(default=slots.PER_PEER, metadata={
        "help": "bulk-channel connections one peer holds at once (a source address; over shm a process)"})
    bulk_grantee_connections: int = dataclasses.field(default=slots.PER_GRANTEE, metadata={
        "help": "bulk-channel connections one grantee holds at once (the NATS user its pull grants went to: every "
                "copy of a receiver model is one); at the cap its idle ones make room, else its next pull is refused"})
    bulk_setup_s: float = dataclasses.field(default=slots.SETUP_S, metadata={
        "help": "how long a bulk-channel connection is held before it completes its first pull"})
    bulk_idle_s: float = dataclasses.field(default=slots.IDLE_S, metadata={
        "help": "how long a bulk-channel connection that completed a pull waits for its next request"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.store_bytes <= 0:
            raise ConfigError("store_bytes must be positive")
        if not 0 <= self.device_store_bytes <= self.store_bytes:
            raise ConfigError("device_store_bytes must be in [0, store_bytes]")
        if self.pull_bytes < 0:
            raise ConfigError("pull_bytes must be >= 0")
        if self.heartbeat_s <= 0:
            raise ConfigError("heartbeat_s must be positive")
        if not 0.1 <= self.grant_ttl_s <= 600:
            raise ConfigError("grant_ttl_s must be in [0.1, 600] seconds")
        if any(not r.strip() for r in self.readers):
            raise ConfigError(f"readers must name receiver models (or '*'): {self.readers}")
        if not 0 <= self.ucx_port < 65536:
            raise ConfigError(f"ucx_port {self.ucx_port} out of range")
        self.slot_limits()  # ConfigError when the bulk_* limits do not fit together

    def slot_limits(self) -> slots.SlotLimits:
        """The bulk server's connection limits (`make_server(..., limits=...)`)."""
        return slots.SlotLimits(max_connections=self.bulk_max_connections, per_peer=self.bulk_peer_connections,
                                per_grantee=self.bulk_grantee_connections,
                                setup_s=self.bulk_setup_s, idle_s=self.bulk_idle_s)
