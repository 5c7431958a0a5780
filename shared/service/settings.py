"""Load a service's frozen config dataclass from flags, env vars, a TOML file, then field defaults.

Field `nats_url` of the sender is `--nats-url` on the command line, `DM_SENDER_NATS_URL` /
`DM_NATS_URL` in the environment, or `nats_url = "..."` in the file named by `--config` (or
`DM_SENDER_CONFIG` / `DM_CONFIG`). Precedence: flags > env > file > defaults. The file holds
only config fields, with TOML types matching theirs (a tuple field is an array), so a typo or a
wrong type is refused instead of silently ignored. Each dataclass validates itself in
`__post_init__`; every failure here is a `ConfigError` (one line), so a bad value stops the
service before it touches the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import tomllib
import typing
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.wire import subjects

C = TypeVar("C")


def _parse(kind: Any, raw: str, name: str) -> Any:
    """A flag's or env var's text as the field's type."""
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


_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}


def _toml_name(kind: Any) -> str:
    return _TOML_TYPES.get(kind, getattr(kind, "__name__", str(kind)))


def value_is(kind: Any, value: Any) -> bool:
    """`value` is of `kind` as a parsed file (TOML, JSON) spells it: a float field takes an
    integer, no number field takes a bool."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _from_toml(kind: Any, value: Any, name: str) -> Any:
    """A file's value as the field's type; TOML already typed it, so only exact kinds pass
    (an integer for a float field is fine; a string "3" for an integer field is not)."""
    if typing.get_origin(kind) is tuple:
        inner = typing.get_args(kind)[0]
        if isinstance(value, list) and all(value_is(inner, v) for v in value):
            return tuple(inner(v) for v in value)
        raise ConfigError(f"{name}: expected an array of {inner.__name__}, got {value!r}")
    if kind in (bool, int, float, str) and value_is(kind, value):
        return kind(value)
    raise ConfigError(f"{name}: expected {_toml_name(kind)}, got {_toml_name(type(value))} {value!r}")


def read_config_file(cls: type, path: str) -> dict[str, Any]:
    """The fields a TOML file sets, typed; unknown keys, wrong types and unreadable or
    malformed files are `ConfigError`s naming the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return {k: _from_toml(hints[k], v, f"config file {path}: {k}") for k, v in data.items()}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a ConfigError (one line) rather than usage text and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def load(cls: type[C], service: str, argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> C:
    env = dict(os.environ) if env is None else env
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # C is a config dataclass; a TypeVar cannot say so
    prefix = f"DM_{service.upper()}_"
    parser = _Parser(prog=f"python -m droidmesh.services.{service}", description=cls.__doc__)
    parser.add_argument("--config", dest="_config", default=None, metavar="FILE",
                        help=f"TOML file of these settings (keys: the flag names with '_'; env {prefix}CONFIG or DM_CONFIG); "
                             "flags and env vars override it")
    for f in fields:
        envs = [f"{prefix}{f.name.upper()}", f"DM_{f.name.upper()}"]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"{f.metadata.get('help', '')} (env {envs[0]} or {envs[1]})")
    args = vars(parser.parse_args(list(argv) if argv is not None else None))
    config_path = args.pop("_config") or env.get(f"{prefix}CONFIG") or env.get("DM_CONFIG")
    values: dict[str, Any] = read_config_file(cls, config_path) if config_path else {}
    for f in fields:
        raw = args[f.name]
        if raw is None:
            raw = env.get(f"{prefix}{f.name.upper()}", env.get(f"DM_{f.name.upper()}"))
        if raw is not None:
            values[f.name] = _parse(hints[f.name], raw, f.name)
    try:
        return cls(**values)
    except TypeError as e:  # a required field without flag/env/file
        raise ConfigError(f"{service}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BusSettings:
    """Fields every service shares: how to reach NATS (auth, TLS), logging, metrics."""

    nats_url: str = dataclasses.field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL(s), comma-separated"})
    nats_user: str = dataclasses.field(default="", metadata={"help": "NATS user of this service's role"})
    nats_password: str = dataclasses.field(default="", metadata={"help": "NATS password (prefer the _file form)"})
    nats_password_file: str = dataclasses.field(default="", metadata={"help": "file holding the NATS password"})
    nats_creds: str = dataclasses.field(default="", metadata={"help": "NATS credentials file (JWT + nkey seed, decentralized auth)"})
    nats_tls_ca: str = dataclasses.field(default="", metadata={"help": "CA bundle: connect with TLS and verify"})
    nats_tls_cert: str = dataclasses.field(default="", metadata={"help": "client certificate (mutual TLS)"})
    nats_tls_key: str = dataclasses.field(default="", metadata={"help": "client key (mutual TLS)"})
    metrics_port: int = dataclasses.field(default=-1, metadata={"help": "HTTP port for /metrics /livez /readyz (0: any, -1: off)"})
    metrics_host: str = dataclasses.field(
        default="127.0.0.1", metadata={"help": "address the health port binds (0.0.0.0 only where probes come from outside)"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug|info|warning|error"})

    def __post_init__(self) -> None:
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level {self.log_level!r} not one of debug|info|warning|error")
        if self.nats_password_file and not os.path.isfile(self.nats_password_file):
            raise ConfigError(f"nats_password_file {self.nats_password_file!r} does not exist")
        for name in ("nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ConfigError(f"{name} {getattr(self, name)!r} does not exist")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ConfigError("nats_tls_cert and nats_tls_key go together")
        if not -1 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port {self.metrics_port} out of range")
        try:
            ipaddress.ip_address(self.metrics_host)
        except ValueError:
            raise ConfigError(f"metrics_host {self.metrics_host!r} is not an IP address") from None

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` (servers, credentials, TLS)."""
        opts: dict[str, Any] = {"servers": [u.strip() for u in self.nats_url.split(",") if u.strip()]}
        password = self.nats_password
        if self.nats_password_file:
            with open(self.nats_password_file) as f:
                password = f.read().strip()
        if self.nats_user:
            # replies arrive under this user's own inbox prefix: the only one the server lets it read
            opts.update(user=self.nats_user, password=password, inbox_prefix=subjects.inbox_prefix(self.nats_user))
        if self.nats_creds:
            opts["user_credentials"] = self.nats_creds
        if self.nats_tls_ca:
            import ssl

            ctx = ssl.create_default_context(cafile=self.nats_tls_ca)
            if self.nats_tls_cert:
                ctx.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
            opts["tls"] = ctx
        return opts
