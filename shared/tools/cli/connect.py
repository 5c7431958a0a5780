"""How a command reaches NATS: one set of connection options, one deadline.

`nats_options` adds `--nats --user --password --creds --tls-ca --tls-cert --tls-key --timeout`
to a command and hands it a `Conn` in their place. `Conn.run(body)` connects and runs
`body(nc)` under ONE deadline of `--timeout` seconds, connecting included: an unreachable
server, a refused login or a silent responder ends in a one-line `MeshUnreachable`, never a
hang. The options become a `BusSettings`, so credentials and TLS are built exactly as the
services build theirs (`BusSettings.nats_options`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.service.settings import BusSettings

T = TypeVar("T")
CLIENT_NAME = "droidmesh-cli"


class MeshUnreachable(DroidMeshError):
    """NATS could not be reached, refused us, or nothing answered within the deadline."""

    code = "unreachable"


@dataclasses.dataclass(frozen=True)
class Conn:
    settings: BusSettings
    timeout: float

    @property
    def url(self) -> str:
        return self.settings.nats_url

    def run(self, body: Callable[[Any], Awaitable[T]], doing: str = "the request") -> T:
        """`body(nc)` on a fresh connection, all of it within `timeout` seconds."""
        return asyncio.run(self._run(body, doing))

    async def _run(self, body: Callable[[Any], Awaitable[T]], doing: str) -> T:
        import nats

        errors: list[Exception] = []  # what the client reported (refused connects, permission violations)

        async def on_error(e: Exception) -> None:  # quiet: the one line below says what failed
            errors.append(e)

        opts = {**self.settings.nats_options(), "name": CLIENT_NAME, "error_cb": on_error,
                "connect_timeout": min(2.0, self.timeout), "max_reconnect_attempts": 1,
                "reconnect_time_wait": 0.2, "allow_reconnect": True}
        nc = None
        deadline = asyncio.timeout(self.timeout)
        try:
            async with deadline:
                try:
                    nc = await nats.connect(**opts)
                except Exception as e:  # refused, no servers, bad TLS: nats-py raises its own kinds
                    raise MeshUnreachable(f"cannot connect to NATS at {self.url}: {_reason(errors, e)}") from None
                return await body(nc)
        except TimeoutError as e:
            if nc is not None and not deadline.expired():  # a request's own timeout, or no responders
                raise MeshUnreachable(str(e) + (f" ({_reason(errors, None)})" if errors else "")) from None
            where = "connecting to" if nc is None else f"{doing} over"
            raise MeshUnreachable(f"timed out after {self.timeout:g}s {where} NATS at {self.url}"
                                  + (f" ({_reason(errors, None)})" if errors else "")) from None
        finally:
            if nc is not None:
                await _close(nc)


def _reason(errors: list[Exception], last: Exception | None) -> str:
    """The most telling error: a permissions or authorization violation beats 'no servers'."""
    for e in reversed(errors):
        text = str(e)
        if "violation" in text.lower():
            return text.strip() + " (see the NATS roles in infra/nats/nats-auth.conf)"
    chosen = errors[-1] if errors else last
    return (str(chosen) or type(chosen).__name__).strip() if chosen is not None else "unknown error"


async def _close(nc: Any) -> None:
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except Exception:  # closing a broken connection: nothing left to tell the user
        pass


def _build(nats_url: str, user: str | None, password: str | None, creds: str | None, tls_ca: str | None,
           tls_cert: str | None, tls_key: str | None, timeout: float) -> Conn:
    try:  # BusSettings validates: files exist, cert and key together
        settings = BusSettings(nats_url=nats_url, nats_user=user or "", nats_password=password or "",
                               nats_creds=creds or "", nats_tls_ca=tls_ca or "", nats_tls_cert=tls_cert or "",
                               nats_tls_key=tls_key or "")
    except ConfigError as e:  # its message names fields; the user typed options
        raise click.UsageError(re.sub(r"\bnats_(tls_cert|tls_key|tls_ca|creds)\b",
                                      lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    return Conn(settings, timeout)


def nats_options(default_timeout: float = 30.0) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the connection options to a click command; it receives them as `conn: Conn`."""
    path = click.Path(exists=True, dir_okay=False)
    options = [
        click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", envvar="DM_NATS_URL", show_default=True,
                     help="NATS server URL(s), comma-separated (env DM_NATS_URL)."),
        click.option("--user", default=None, envvar="DM_NATS_USER", help="NATS user (env DM_NATS_USER)."),
        click.option("--password", default=None, envvar="DM_NATS_PASSWORD", help="NATS password (env DM_NATS_PASSWORD)."),
        click.option("--creds", type=path, default=None, help="NATS credentials file (JWT + nkey)."),
        click.option("--tls-ca", type=path, default=None, help="CA bundle: connect with TLS and verify the server."),
        click.option("--tls-cert", type=path, default=None, help="Client certificate (mutual TLS, with --tls-key)."),
        click.option("--tls-key", type=path, default=None, help="Client key (mutual TLS, with --tls-cert)."),
        click.option("--timeout", default=default_timeout, show_default=True, type=click.FloatRange(0.1, 3600),
                     help="Seconds for the whole command's NATS work, connecting included."),
    ]

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def command(*args: Any, nats_url: str, user: str | None, password: str | None, creds: str | None,
                    tls_ca: str | None, tls_cert: str | None, tls_key: str | None, timeout: float, **kwargs: Any) -> Any:
            return f(*args, conn=_build(nats_url, user, password, creds, tls_ca, tls_cert, tls_key, timeout), **kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return decorate
