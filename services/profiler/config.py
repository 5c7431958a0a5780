"""Profiler configuration (flags / DM_PROFILER_* / DM_* env)."""

from __future__ import annotations

import dataclasses

from shared.errors import ConfigError
from shared.model.adapter import DTYPES


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    """Profiles pairs on request (off the event loop) and publishes configs to the bucket."""

    nats_url: str = dataclasses.field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "dtype models are profiled in"})
    max_rows: int = dataclasses.field(default=500, metadata={"help": "cap on n_train / n_test per request"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug|info|warning|error"})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.max_rows < 1:
            raise ConfigError("max_rows must be >= 1")
