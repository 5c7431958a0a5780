"""Bulk-channel addresses: where a holder sits, as the receiver keys what its pulls achieve."""

from __future__ import annotations

import pytest

from droidmesh.shared.transport.address import link_of


@pytest.mark.parametrize(("transport", "address", "link"), [
    ("shm", "/tmp/droidmesh-shm-x/bulk.sock", "shm"),  # always this host
    ("inproc", "anything", "inproc"),
    ("ucx", "10.0.0.7:13337", "ucx 10.0.0.7"),  # every port on one host shares its link
    ("nixl", "[fe80::1]:4000", "nixl [fe80::1]"),
    ("ucx", "not an address", "ucx not an address"),  # a key only: never dialled from here
])
def test_a_holders_link_is_its_host_or_this_host(transport, address, link):
    assert link_of(transport, address) == link
