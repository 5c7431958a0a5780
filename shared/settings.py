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

from droidmesh.shared.errors import ConfigError

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
    parser = argparse.ArgumentParser(prog=f"python -m droidmesh.services.{service}", description=cls.__doc__)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # C is a config dataclass; a TypeVar cannot say so
        envs = [f"DM_{service.upper()}_{f.name.upper()}", f"DM_{f.name.upper()}"]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"{f.metadata.get('help', '')} (env {envs[0]} or {envs[1]})")
    args = vars(parser.parse_args(list(argv) if argv is not None else None))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # as above
        raw = args[f.name]
        if raw is None:
            raw = env.get(f"DM_{service.upper()}_{f.name.upper()}", env.get(f"DM_{f.name.upper()}"))
        if raw is not None:
            values[f.name] = _parse(hints[f.name], raw, f.name)
    try:
        return cls(**values)
    except TypeError as e:  # a required field without flag/env
        raise ConfigError(f"{service}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BusSettings:
    """Fields every service shares: how to reach NATS (auth, TLS), logging, metrics."""

    nats_url: str = dataclasses.field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL(s), comma-separated"})
    nats_user: str = dataclasses.field(default="", metadata={"help": "NATS user of this service's role"})
    nats_password: str = dataclasses.field(default="", metadata={"help": "NATS password (prefer the _file form)"})
    nats_password_file: str = dataclasses.field(default="", metadata={"help": "file holding the NATS password"})
    nats_tls_ca: str = dataclasses.field(default="", metadata={"help": "CA bundle: connect with TLS and verify"})
    nats_tls_cert: str = dataclasses.field(default="", metadata={"help": "client certificate (mutual TLS)"})
    nats_tls_key: str = dataclasses.field(default="", metadata={"help": "client key (mutual TLS)"})
    metrics_port: int = dataclasses.field(default=-1, metadata={"help": "HTTP port for /metrics /livez /readyz (0: any, -1: off)"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug|info|warning|error"})

    def __post_init__(self) -> None:
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level {self.log_level!r} not one of debug|info|warning|error")
        if self.nats_password_file and not os.path.isfile(self.nats_password_file):
            raise ConfigError(f"nats_password_file {self.nats_password_file!r} does not exist")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ConfigError(f"{name} {getattr(self, name)!r} does not exist")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ConfigError("nats_tls_cert and nats_tls_key go together")
        if not -1 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port {self.metrics_port} out of range")

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` (servers, credentials, TLS)."""
        opts: dict[str, Any] = {"servers": [u.strip() for u in self.nats_url.split(",") if u.strip()]}
        password = self.nats_password
        if self.nats_password_file:
            with open(self.nats_password_file) as f:
                password = f.read().strip()
        if self.nats_user:
            opts.update(user=self.nats_user, password=password)
        if self.nats_tls_ca:
            import ssl

            ctx = ssl.create_default_context(cafile=self.nats_tls_ca)
            if self.nats_tls_cert:
                ctx.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
            opts["tls"] = ctx
        return opts
