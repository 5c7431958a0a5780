"""Sender configuration (flags / DM_SENDER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.holding.settings import HolderSettings
from droidmesh.shared.model.device import DTYPES, check_device_name, default_dtype_name
from droidmesh.shared.transport.bulk import TRANSPORTS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SenderConfig(HolderSettings):
    """Hosts one model; prefills contexts and serves their KV/E to receivers."""

    model_path: str = dataclasses.field(metadata={"help": "local HF checkpoint directory"})
    model_id: str = dataclasses.field(default="", metadata={"help": "id announced (default: directory name)"})
    transport: str = dataclasses.field(default="ucx", metadata={
        "help": "bulk channel serving pulls (ucx; nixl; shm: receivers on this host; inproc: same process, tests)"})
    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu, cuda or cuda:N: where the model runs"})
    dtype: str = dataclasses.field(default="", metadata={"help": "weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)"})
    e_layers: tuple[int, ...] = dataclasses.field(default=(0,), metadata={"help": "layers whose E is kept"})
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
        if any(l < 0 for l in self.e_layers):
            raise ConfigError(f"e_layers must be >= 0: {self.e_layers}")
        if not self.model_id:
            object.__setattr__(self, "model_id", Path(self.model_path).name)
        if not self.sender_id:
            object.__setattr__(self, "sender_id", f"{self.model_id}-{os.getpid()}")
