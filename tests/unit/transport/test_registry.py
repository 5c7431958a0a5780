"""The channel registry: every transport the wire names is registered, each factory builds its
channel's class, and asking for one channel imports no other's module."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from droidmesh.shared.errors import TransferError
from droidmesh.shared.transport import bulk, registry
from droidmesh.shared.wire.schemas import Transport


def test_every_wire_transport_is_registered_once():
    assert bulk.TRANSPORTS is registry.TRANSPORTS
    assert sorted(registry.TRANSPORTS) == sorted(registry.CHANNELS) == sorted(get_args(Transport))


@pytest.mark.parametrize("transport", registry.TRANSPORTS)
def test_factories_build_the_registered_classes(transport):
    found = registry.channel(transport)
    client = bulk.make_client(transport)
    server = bulk.make_server(transport, lambda c, l, k: None, None)
    assert (type(client), type(server)) == (registry.load(found.client), registry.load(found.server))
    assert client.transport == server.transport == transport


def test_an_unknown_transport_is_a_transfer_error():
    with pytest.raises(TransferError, match="unknown transport 'rdma'"):
        bulk.make_client("rdma")
    with pytest.raises(TransferError, match="unknown transport"):
        bulk.make_server("", lambda c, l, k: None, None)


def test_only_the_chosen_channel_is_imported():
    """A fresh interpreter that builds an shm client and server has loaded neither the UCX nor the
    NIXL package (nor ucxx or NIXL themselves)."""
    code = ("import sys\n"
            "from droidmesh.shared.transport.bulk import make_client, make_server\n"
            "make_client('shm'); make_server('shm', lambda c, l, k: None, None)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[-1] in ('ucx', 'nixl', 'ucxx', 'nixl_cu12')"
            " or '.ucx.' in m or '.nixl.' in m))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
