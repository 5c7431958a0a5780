"""Sender configuration (flags / DM_SENDER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.device import DTYPES, check_device_name, default_dtype_name
from droidmesh.shared.service.settings import BusSettings
from droidmesh.shared.transport import slots
from droidmesh.shared.transport.bulk import TRANSPORTS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SenderConfig(BusSettings):
    """Hosts one model; prefills contexts and serves their KV/E to receivers."""

    model_path: str = dataclasses.field(metadata={"help": "local HF checkpoint directory"})
    model_id: str = dataclasses.field(default="", metadata={"help": "id announced (default: directory name)"})
    transport: str = dataclasses.field(default="ucx", metadata={
        "help": "bulk channel serving pulls (ucx; nixl; shm: receivers on this host; inproc: same process, tests)"})
    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu, cuda or cuda:N: where the model runs"})
    dtype: str = dataclasses.field(default="", metadata={"help": "weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)"})
    store_bytes: int = dataclasses.field(default=2 << 30, metadata={"help": "byte budget of the KV/E store (pinned by pulls too)"})
    pull_bytes: int = dataclasses.field(default=1 << 30, metadata={
        "help": "byte budget of copies made for pulls in flight (prefix slices, CUDA staging); past it a pull is refused"})
    e_layers: tuple[int, ...] = dataclasses.field(default=(0,), metadata={"help": "layers whose E is kept"})
    heartbeat_s: float = dataclasses.field(default=1.0, metadata={"help": "heartbeat interval"})
    grant_ttl_s: float = dataclasses.field(default=10.0, metadata={
        "help": "lifetime of a single-use pull grant (asked for just before each pull)"})
    readers: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "receiver models granted pulls besides this model's own and those a pair config names "
                "(default groups, translators, explicit modes; '*': any); checked under NATS auth"})
    ucx_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address receivers reach us at"})
    ucx_port: int = dataclasses.field(default=0, metadata={"help": "UCX listener port (0: ephemeral)"})
    bulk_max_connections: int = dataclasses.field(default=slots.MAX_CONNECTIONS, metadata={
        "help": "bulk-channel connections held at once (ucx, nixl, shm); at the cap an idle one makes room"})
    bulk_peer_connections: int = dataclasses.field(default=slots.PER_PEER, metadata={
        "help": "bulk-channel connections one peer holds at once (a source address; over shm a process)"})
    bulk_setup_s: float = dataclasses.field(default=slots.SETUP_S, metadata={
        "help": "how long a bulk-channel connection is held before it completes its first pull"})
    bulk_idle_s: float = dataclasses.field(default=slots.IDLE_S, metadata={
        "help": "how long a bulk-channel connection that completed a pull waits for its next request"})
    sender_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: model_id-pid)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (Path(self.model_path) / "config.json").is_file() and not (
            Path(self.model_path) / "adapter_config.json"
        ).is_file():
            raise ConfigError(f"model_path {self.model_path!r} holds no checkpoint")
        check_device_name(self.device)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport {self.transport!r} not one of {TRANSPORTS}")
        if not self.dtype:
            object.__setattr__(self, "dtype", default_dtype_name(self.device))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.store_bytes <= 0:
            raise ConfigError("store_bytes must be positive")
        if self.pull_bytes < 0:
            raise ConfigError("pull_bytes must be >= 0")
        if self.heartbeat_s <= 0:
            raise ConfigError("heartbeat_s must be positive")
        if not 0.1 <= self.grant_ttl_s <= 600:
            raise ConfigError("grant_ttl_s must be in [0.1, 600] seconds")
        if any(not r.strip() for r in self.readers):
            raise ConfigError(f"readers must name receiver models (or '*'): {self.readers}")
        if any(l < 0 for l in self.e_layers):
            raise ConfigError(f"e_layers must be >= 0: {self.e_layers}")
        if not 0 <= self.ucx_port < 65536:
            raise ConfigError(f"ucx_port {self.ucx_port} out of range")
        self.slot_limits()  # ConfigError when the bulk_* limits do not fit together
        if not self.model_id:
            object.__setattr__(self, "model_id", Path(self.model_path).name)
        if not self.sender_id:
            object.__setattr__(self, "sender_id", f"{self.model_id}-{os.getpid()}")

    def slot_limits(self) -> slots.SlotLimits:
        """The bulk server's connection limits (`make_server(..., limits=...)`)."""
        return slots.SlotLimits(max_connections=self.bulk_max_connections, per_peer=self.bulk_peer_connections,
                                setup_s=self.bulk_setup_s, idle_s=self.bulk_idle_s)
