"""The bulk channels by name: which module holds each side, imported only when asked for.

`make_server` / `make_client` (re-exported by `bulk.py`, where callers import them) look a
channel up here and import just its server or client module, so a sender running `shm` never
loads ucxx or NIXL. A channel is registered as "module:Class" strings, never as classes: this
module imports no channel. Called on the services' event loop at start-up (construction only:
nothing here does I/O beyond the import).

Adding a channel: a `BulkServer` / `BulkClient` pair (`bulk.py` has the protocol, `client.py`
the client skeleton), one `register` line below, and its name in `schemas.Transport`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from droidmesh.shared.errors import TransferError

if TYPE_CHECKING:
    from droidmesh.shared.transport.bulk import Authorize, BulkClient, BulkServer, Pin, TensorLookup
    from droidmesh.shared.transport.slots import SlotLimits
    from droidmesh.shared.wire.schemas import Transport


@dataclasses.dataclass(frozen=True)
class Channel:
    server: str  # "package.module:Class"
    client: str
    server_options: tuple[str, ...] = ()  # which of make_server's keywords its server takes (beside pin)


CHANNELS: dict[str, Channel] = {}


def register(name: str, server: str, client: str, server_options: tuple[str, ...] = ()) -> None:
    CHANNELS[name] = Channel(server, client, server_options)


_T = "droidmesh.shared.transport"
register("ucx", f"{_T}.ucx.server:UcxBulkServer", f"{_T}.ucx.client:UcxBulkClient", ("host", "port", "limits"))
register("inproc", f"{_T}.inproc:InProcessBulkServer", f"{_T}.inproc:InProcessBulkClient", ("name",))
register("nixl", f"{_T}.nixl.server:NixlBulkServer", f"{_T}.nixl.client:NixlBulkClient", ("host", "port", "limits"))
register("shm", f"{_T}.shm.server:ShmBulkServer", f"{_T}.shm.client:ShmBulkClient", ("limits",))

TRANSPORTS: tuple[Transport, ...] = ("ucx", "inproc", "nixl", "shm")


def channel(name: str) -> Channel:
    found = CHANNELS.get(name)
    if found is None:
        raise TransferError(f"unknown transport {name!r}; expected one of {TRANSPORTS}")
    return found


def load(target: str) -> Any:
    """The class named by "module:Class" (its module imported now)."""
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_server(transport: str, lookup: TensorLookup, authorize: Authorize | None, *, host: str = "127.0.0.1",
                port: int = 0, name: str = "", pin: Pin | None = None, limits: SlotLimits | None = None) -> BulkServer:
    """The sender's server for `transport` (ucx, nixl listen on host:port; shm on a Unix socket of
    its own; inproc registers `name`);
    `pin` holds what each pull sends against the store's budgets (None: nothing is counted);
    `limits` bounds the connections a networked channel holds (`slots.py`; None: the defaults)."""
    found = channel(transport)
    given = {"host": host, "port": port, "name": name, "limits": limits}
    server: BulkServer = load(found.server)(lookup, authorize, pin=pin,
                                            **{k: given[k] for k in found.server_options})
    return server


def make_client(transport: str) -> BulkClient:
    client: BulkClient = load(channel(transport).client)()
    return client
