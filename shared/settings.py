"""Load a service's frozen config dataclass from flags, then env vars, then field defaults.

Field `nats_url` of the sender is `--nats-url` on the command line or `DM_SENDER_NATS_URL` /
`DM_NATS_URL` in the environment. Each dataclass validates itself in `__post_init__` and raises
`ConfigError`, so a bad value stops the service before it touches the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

from shared.errors import ConfigError

C = TypeVar("C")


def _parse(kind: Any, raw: str, name: str) -> Any:
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if typing.get_origin(kind) is tuple:
            inner = typing.get_args(kind)[0]
            return tuple(inner(v) for v in raw.split(",") if v.strip())
        if kind in (int, float, str):
            return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}: cannot parse {raw!r} as {getattr(kind, '__name__', kind)}") from None
    raise ConfigError(f"{name}: unsupported config type {kind}")


def load(cls: type[C], service: str, argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> C:
    env = dict(os.environ) if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}", description=cls.__doc__)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        envs = [f"DM_{service.upper()}_{f.name.upper()}", f"DM_{f.name.upper()}"]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"{f.metadata.get('help', '')} (env {envs[0]} or {envs[1]})")
    args = vars(parser.parse_args(list(argv) if argv is not None else None))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = args[f.name]
        if raw is None:
            raw = env.get(f"DM_{service.upper()}_{f.name.upper()}", env.get(f"DM_{f.name.upper()}"))
        if raw is not None:
            values[f.name] = _parse(hints[f.name], raw, f.name)
    try:
        return cls(**values)
    except TypeError as e:  # a required field without flag/env
        raise ConfigError(f"{service}: {e}") from None
