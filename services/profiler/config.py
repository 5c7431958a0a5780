"""Profiler configuration (flags / DM_PROFILER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.device import DTYPES, check_device_name, default_dtype_name
from droidmesh.shared.service.settings import BusSettings
from droidmesh.shared.wire import subjects


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilerConfig(BusSettings):
    """Profiles pairs on request (off the event loop) and publishes configs to the bucket."""

    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu, cuda or cuda:N: where the model runs"})
    dtype: str = dataclasses.field(default="", metadata={"help": "profiling dtype (default: bfloat16 on cuda, float32 on cpu)"})
    max_rows: int = dataclasses.field(default=500, metadata={"help": "cap on n_train / n_test per request"})
    models: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "'id=checkpoint dir' pairs: model ids a request names resolve here first (an operator's also as a "
                "path or zoo name); the receivers of each id may ask re-profiles, naming only these ids"})
    queue_size: int = dataclasses.field(default=4, metadata={
        "help": "profile requests held at once (one runs, the rest wait; operators' go first); one more is "
                "refused at once as busy. Receivers' requests never take the last place: it is operators'"})
    per_receiver: int = dataclasses.field(default=1, metadata={
        "help": "re-profile requests the receivers of one model hold at once; more are refused as busy"})
    reprofile_rows: int = dataclasses.field(default=64, metadata={"help": "cap on a re-profile request's calibration rows"})
    rows_bytes: int = dataclasses.field(default=512 * 1024, metadata={
        "help": "cap on the text (UTF-8 bytes) of a request's calibration rows"})
    data_root: str = dataclasses.field(default="", metadata={
        "help": "directory an operator's request may name data files under (regular files only, no symlinks); "
                "empty: requests name no data files"})
    max_data_bytes: int = dataclasses.field(default=64 * 1024 * 1024, metadata={"help": "cap on one data file's size"})

    def model_paths(self) -> dict[str, str]:
        return dict(m.split("=", 1) for m in self.models)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device_name(self.device)
        if not self.dtype:
            object.__setattr__(self, "dtype", default_dtype_name(self.device))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        for name in ("max_rows", "per_receiver", "rows_bytes", "max_data_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.reprofile_rows < 2 or self.queue_size < 2:  # two rows split in two; a place kept for operators
            raise ConfigError("reprofile_rows and queue_size must be >= 2")
        bad = [m for m in self.models if "=" not in m or not all(m.split("=", 1))]
        if bad:
            raise ConfigError(f"models entries must be 'id=checkpoint dir', got {bad}")
        tokens = [subjects.model_token(i) for i in self.model_paths()]
        if len(set(tokens)) != len(self.models):  # each id is its receivers' own subject
            raise ConfigError(f"models ids must be distinct subject tokens, got {sorted(self.model_paths())}")
        if self.data_root and not os.path.isdir(self.data_root):
            raise ConfigError(f"data_root {self.data_root!r} is not a directory")
