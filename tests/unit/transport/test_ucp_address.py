"""UCX worker addresses and remote keys from a peer are walked and checked before UCX sees them:
nothing UCX would abort on, read past or misindex gets through, and our own shapes do."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport import ucp_address as ua
from droidmesh.shared.transport import ucp_rkey

HOST = bytes.fromhex("bda8b9e9fdcd1a16")  # a host id without a namespace
OTHER_HOST = bytes.fromhex("0102030405060716")
NS_ID = bytes.fromhex("bda8b9e9fdcd1a96") + bytes(8)  # flagged (top bit): a namespace id follows
ATTR = struct.pack("<fffI", 1e-8, 1.2e10, 8e-8, 0x234F00)


def pack(devices: list[tuple[int, bytes, list[tuple[int, bytes]]]], header: int = 0x20, uuid: bytes = b"\x11" * 8,
         attr: bytes = ATTR) -> bytes:
    """A v1 worker address as UCX packs one: header, uuid, per device (md, address, interfaces),
    then the release-version pseudo device."""
    out = bytearray([header]) + uuid
    for md, dev, tls in devices:
        out += bytes([md, len(dev)]) + dev
        for i, (tl, iface) in enumerate(tls):
            out += struct.pack("<H", tl) + attr + bytes([len(iface) | (0x80 if i == len(tls) - 1 else 0)]) + iface
    return bytes(out + bytes([0x85, 0x80]))


def ours(host: bytes = HOST, self_id: bytes = b"S" * 8) -> bytes:
    loopback = host[:7] + bytes([host[7] | 0x80]) + bytes(8)  # the host id flagged, then a network namespace id
    return pack([(0, b"", [(ua.SELF, self_id)]),
                 (1, b"\x00\x02" + bytes([192, 0, 2, 2]), [(ua.TCP, b"\x95\xc3")]),
                 (1, b"\x01\x02" + loopback, [(ua.TCP, b"\x94\x59")]),
                 (2, host, [(ua.SYSV, bytes(8))]),
                 (3, host, [(ua.POSIX, bytes(8))]),
                 (4, host, [(ua.CMA, b"xN\x00\x00")])])


def theirs() -> bytes:
    """A sender's on another host (its own host id and loopback id)."""
    return ours(OTHER_HOST, b"T" * 8)


LOCAL = ua.LocalView.of(ours())


def test_crc16_is_ucx_transport_checksum():
    assert (ua.crc16("tcp"), ua.crc16("self"), ua.crc16("posix")) == (0x19CF, 0x7563, 0xD3A7)


def test_our_own_shape_parses_and_passes():
    parsed = ua.check_peer(ours(), LOCAL, peer_on_this_host=True)
    assert [e.md for e in parsed.entries] == [0, 1, 1, 2, 3, 4]


def test_every_truncation_and_any_trailing_byte_is_refused():
    address = ours()
    for n in range(len(address)):
        with pytest.raises(BadMessageError):
            ua.parse_worker_address(address[:n])
    with pytest.raises(BadMessageError, match="after its end"):
        ua.parse_worker_address(address + b"\0")


@pytest.mark.parametrize("version", range(2, 16))
def test_a_version_ucx_asserts_on_is_refused(version):
    with pytest.raises(BadMessageError, match="unknown version"):
        ua.parse_worker_address(bytes([0x20 | version]) + ours()[1:])


def test_a_memory_domain_past_ucx_arrays_is_refused():
    with pytest.raises(BadMessageError, match="memory domain 100"):
        ua.parse_worker_address(pack([(100, HOST, [(ua.SYSV, bytes(8))])]))


def test_endpoint_addresses_are_refused():
    address = bytearray(pack([(2, HOST, [(ua.SYSV, bytes(8))])]))
    address[1 + 8 + 2 + 8 + 2 + 16] |= 0x40  # the interface's length byte: "endpoint addresses follow"
    with pytest.raises(BadMessageError, match="endpoint addresses"):
        ua.parse_worker_address(bytes(address))


def test_non_finite_or_zero_bandwidth_attributes_are_refused():
    for attr in (struct.pack("<fffI", 1e-8, float("nan"), 0, 0), struct.pack("<fffI", 1e-8, 0.0, 0, 0)):
        with pytest.raises(BadMessageError, match="interface attribute"):
            ua.parse_worker_address(pack([(2, HOST, [(ua.SYSV, bytes(8))])], attr=attr))


@pytest.mark.parametrize("entry", [
    (1, b"\x00\x02" + bytes(16), (ua.TCP, b"\x95\xc3")),  # IPv4 family with 16 address bytes
    (1, b"\x00\x07" + bytes(4), (ua.TCP, b"\x95\xc3")),  # an unknown family
    (1, b"\x01\x02" + HOST[:7], (ua.TCP, b"\x95\xc3")),  # loopback: a short host id
    (1, b"\x00\x02" + bytes(4), (ua.TCP, b"\x95")),  # a 1-byte port
    (4, HOST, (ua.CMA, b"xN\x00\x80")),  # pid flagged as namespaced, no namespace id
    (3, HOST, (ua.POSIX, bytes(8) + b"/dev/shm")),  # a directory path without its NUL
    (2, HOST[:4], (ua.SYSV, bytes(8))),  # a short host id
    (0, b"", (ua.SELF, b"S" * 4)),  # a short loopback id
])
def test_entries_a_local_transport_would_misread_are_refused(entry):
    md, dev, tl = entry
    with pytest.raises(BadMessageError, match="would misread"):
        ua.check_peer(pack([(md, dev, [tl])]), LOCAL, peer_on_this_host=True)


def test_transports_we_do_not_run_are_not_shape_checked():
    ua.check_peer(pack([(5, b"\x01", [(ua.crc16("rc_mlx5"), b"\x02\x03\x04")])]), LOCAL, peer_on_this_host=False)


def test_a_peer_elsewhere_may_not_claim_this_hosts_shared_memory():
    claim = pack([(2, HOST, [(ua.SYSV, bytes(8))])])
    ua.check_peer(claim, LOCAL, peer_on_this_host=True)
    with pytest.raises(BadMessageError, match="not on this host claims"):
        ua.check_peer(claim, LOCAL, peer_on_this_host=False)
    with pytest.raises(BadMessageError, match="not on this host claims"):
        ua.check_peer(pack([(0, b"", [(ua.SELF, b"S" * 8)])]), LOCAL, peer_on_this_host=False)
    ua.check_peer(theirs(), LOCAL, peer_on_this_host=False)  # its own host: UCX finds it unreachable
    loopback = pack([(1, b"\x01\x02" + NS_ID, [(ua.TCP, b"\x00\x16")])])  # our loopback: a port of this host
    with pytest.raises(BadMessageError, match="not on this host claims"):
        ua.check_peer(loopback, LOCAL, peer_on_this_host=False)


def test_a_claim_cannot_hide_behind_a_short_namespace_id():
    """UCX reads a namespace id at its own size: past a 4-byte one into the bytes that follow (here
    an ignored entry's checksum and attributes, all zero). The claim is judged on what UCX reads."""
    local = ua.LocalView.of(pack([(2, NS_ID, [(ua.SYSV, bytes(8))])]))
    forged = pack([(2, NS_ID[:12], [(0x0000, b""), (ua.SYSV, bytes(8))])], attr=struct.pack("<fffI", 0.0, 1e9, 0, 0))
    ua.check_peer(forged, local, peer_on_this_host=True)
    with pytest.raises(BadMessageError, match="not on this host claims"):
        ua.check_peer(forged, local, peer_on_this_host=False)


def test_an_own_address_that_does_not_parse_refuses_every_peer():
    with pytest.raises(BadMessageError, match="own worker address"):
        ua.LocalView.of(b"\x02" + ours()[1:])


@pytest.mark.fuzz
@settings(max_examples=400, deadline=None)
@given(data=st.one_of(st.binary(max_size=400),
                      st.tuples(st.integers(0, 220), st.binary(min_size=1, max_size=6)).map(
                          lambda c: ours()[:c[0]] + c[1] + ours()[c[0] + len(c[1]):])))
def test_any_bytes_parse_or_raise_bad_message(data):
    try:
        ua.check_peer(data, LOCAL, peer_on_this_host=True)
    except BadMessageError:
        pass


# -- remote keys --------------------------------------------------------------------------------
PEER = ua.parse_worker_address(theirs())


def rkey(md_map: int = 1, mem_type: int = 0, keys: tuple[bytes, ...] = (b"",), sys_dev: int = 0xFF) -> bytes:
    return struct.pack("<QB", md_map, mem_type) + b"".join(bytes([len(k)]) + k for k in keys) + bytes([sys_dev])


def test_a_host_memory_key_for_an_offered_domain_passes():
    ucp_rkey.check_rkey(rkey(), PEER)
    ucp_rkey.check_rkey(struct.pack("<QB", 0, 0), PEER)  # UCX over TCP alone: no md, map and memory type only
    ucp_rkey.check_rkey(rkey(md_map=0b10001, keys=(b"", b"\x01\x02")), PEER)


@pytest.mark.parametrize("key, match", [
    (rkey(mem_type=1), "memory type"),
    (struct.pack("<QB", 0, 1), "memory type"),
    (rkey(md_map=1 << 9), "does not offer"),
    (rkey(md_map=1 << 2), "does not offer"),  # sysv's FIFO domain
    (rkey(sys_dev=3), "system device"),
    (rkey()[:-1], "remote key"),
    (rkey() + b"\0", "after its end"),
    (rkey(keys=(b"\x01" * 3,))[:-2], "ends inside"),
])
def test_keys_ucx_would_misread_are_refused(key, match):
    with pytest.raises(BadMessageError, match=match):
        ucp_rkey.check_rkey(key, PEER)
