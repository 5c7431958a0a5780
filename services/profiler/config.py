"""Profiler configuration (flags / DM_PROFILER_* / DM_* env)."""

from __future__ import annotations

import dataclasses

from shared.errors import ConfigError
from shared.settings import BusSettings
from shared.model.adapter import DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilerConfig(BusSettings):
    """Profiles pairs on request (off the event loop) and publishes configs to the bucket."""

    dtype: str = dataclasses.field(default="float32", metadata={"help": "dtype models are profiled in"})
    max_rows: int = dataclasses.field(default=500, metadata={"help": "cap on n_train / n_test per request"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.max_rows < 1:
            raise ConfigError("max_rows must be >= 1")
