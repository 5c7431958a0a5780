"""Profiler configuration (flags / DM_PROFILER_* / DM_* env)."""

from __future__ import annotations

import dataclasses

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.device import DTYPES, check_device_name, default_dtype_name
from droidmesh.shared.service.settings import BusSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilerConfig(BusSettings):
    """Profiles pairs on request (off the event loop) and publishes configs to the bucket."""

    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu, cuda or cuda:N: where the model runs"})
    dtype: str = dataclasses.field(default="", metadata={"help": "profiling dtype (default: bfloat16 on cuda, float32 on cpu)"})
    max_rows: int = dataclasses.field(default=500, metadata={"help": "cap on n_train / n_test per request"})
    models: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "'id=checkpoint dir' pairs: model ids a request names (a receiver's re-profile request names ids) "
                "resolve here first, then as a path or zoo name"})

    def model_paths(self) -> dict[str, str]:
        return dict(m.split("=", 1) for m in self.models)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device_name(self.device)
        if not self.dtype:
            object.__setattr__(self, "dtype", default_dtype_name(self.device))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.max_rows < 1:
            raise ConfigError("max_rows must be >= 1")
        bad = [m for m in self.models if "=" not in m or not all(m.split("=", 1))]
        if bad:
            raise ConfigError(f"models entries must be 'id=checkpoint dir', got {bad}")
