"""What an engine's DroidMesh connector is told by its operator (vLLM: `kv_connector_extra_config`).

The NATS fields are the services' own (`BusSettings`: a receiver role's user, a password file,
TLS), the holding ones the holders' (`HolderSettings`: store, readers, bulk server, used with
`hold`); the rest names the models the engine serves as DroidMesh model ids and checkpoints, the
scope its lookups read (and its holds are in), and the deadlines. Unknown keys and wrong types are refused
(`ConfigError`, one line), as the services' configs are.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.holding.settings import HolderSettings
from droidmesh.shared.model.device import check_device_name
from droidmesh.shared.service.settings import value_is
from droidmesh.shared.transport.bulk import TRANSPORTS
from droidmesh.shared.wire.hashing import PUBLIC

MODES = ("auto", "full_prefill", "full_reuse")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings(HolderSettings):
    # model id -> checkpoint (a model directory or a LoRA adapter's); the engine's base model is
    # `base_model`, and a LoRA request's adapter name is its model id
    models: dict[str, str] = dataclasses.field(default_factory=dict)
    base_model: str = ""
    scope: str = PUBLIC  # the scope every lookup of this engine reads (its tenant), with public
    transport: str = "ucx"  # the bulk channel pulls use (the holders' own)
    lookup_timeout_s: float = 1.0
    reuse_timeout_s: float = 10.0  # a pull and the recompute over it; past it the engine prefills
    connect_timeout_s: float = 15.0
    # a load runs beside the engine's steps (vLLM's asynchronous loads: the request waits, the
    # others go on) rather than inside the step that first schedules its request
    async_load: bool = False
    # load the receiver's own weights (and build their screens) as soon as the engine's caches are
    # registered, beside its start, instead of inside the first request that reuses
    preload: bool = True
    kv_screen: bool = True  # screen pulled tensors against the receiver's own statistics
    dtype: str = "float32"  # the receiver's own layers (the recomputed group), as the holders' K/V and E
    # where those layers run (and the screen, and a held context's E): cpu, or the engine's GPU
    # (cuda, cuda:N) so a GPU engine's plan is recomputed there and its K/V never crosses the host
    device: str = "cpu"
    # vLLM as a sender (`engines/holding.py`): hold what the engine prefilled itself, in `scope`,
    # under `holder_id` (under NATS auth the roster's `--holder MODEL=ID` of this receiver user),
    # with E at `hold_e_layers` besides those the pair configs naming its models as senders use;
    # the store and bulk server are the holder settings' (`store_bytes`, `readers`, `ucx_host`, ...)
    hold: bool = False
    holder_id: str = ""
    hold_e_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.models or self.base_model not in self.models:
            raise ConfigError(f"base_model {self.base_model!r} must be one of models {sorted(self.models)}")
        for name, path in self.models.items():
            if not name or not Path(path).is_dir():
                raise ConfigError(f"model {name!r}: checkpoint {path!r} is not a directory")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport {self.transport!r} not one of {TRANSPORTS}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} not one of float32, bfloat16, float16")
        check_device_name(self.device)
        if not self.scope:
            raise ConfigError("scope must not be empty")
        if self.hold and not self.holder_id:
            raise ConfigError("hold needs a holder_id (under NATS auth, one the roster gives this user)")
        for name in ("lookup_timeout_s", "reuse_timeout_s", "connect_timeout_s"):
            if not 0 < getattr(self, name) <= 600:
                raise ConfigError(f"{name} {getattr(self, name)} must be in (0, 600]")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> EngineSettings:
        """From the engine's free-form dict: every key a field, every value of the field's type."""
        hints = typing.get_type_hints(cls)
        known = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"unknown DroidMesh connector settings {unknown}; known: {sorted(known)}")
        raw = {k: tuple(v) if isinstance(v, list) and typing.get_origin(known.get(k)) is tuple else v
               for k, v in raw.items()}  # JSON has lists where the settings keep tuples
        for key, value in raw.items():
            kind = typing.get_origin(known[key]) or known[key]
            items = value if kind is tuple and isinstance(value, tuple) else (value,)
            item_kind = typing.get_args(known[key])[0] if kind is tuple else kind
            for item in items:
                if not value_is(item_kind, item):
                    raise ConfigError(f"connector setting {key}: {type(item).__name__} where {item_kind.__name__} "
                                      "is expected")
        values: dict[str, Any] = {k: float(v) if known[k] is float else v for k, v in raw.items()}
        return cls(**values)

    def model_for(self, lora_name: str | None) -> str | None:
        """The model id a request is served as: its adapter's, or the base's; None if not ours."""
        name = lora_name or self.base_model
        return name if name in self.models else None

