"""A sender's NIXL grant metadata is walked as NIXL serialises it and accepted only in the shape a
DroidMesh sender produces (a connection's first grant with the agent's connection, later ones
without, every one naming the same agent); its UCX worker address and remote keys are checked on
the way."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport import ucp_rkey
from droidmesh.shared.transport.nixl import metadata
from droidmesh.shared.transport.ucp_address import crc16
from tests.unit.transport.test_ucp_address import LOCAL, pack, rkey, theirs


def field(tag: bytes, data: bytes) -> bytes:
    return tag + len(data).to_bytes(8, "little") + data + b"|"


def u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def blob(name: bytes = b"droidmesh-nixl-sender-1", conns: list[bytes] | None = None, sections: bytes = field(b"nixlSecElms", u64(0)),
         backend: bytes = b"UCX") -> bytes:
    conns = [theirs()] if conns is None else conns
    out = metadata.MAGIC + field(b"Agent", name) + field(b"Conns", u64(len(conns)))
    for c in conns:
        out += field(b"t", backend) + field(b"c", c)
    return out + field(b"", b"MemSection") + sections


def section(descs: list[bytes], mem: int = 0, backend: bytes = b"UCX") -> bytes:
    return (field(b"nixlSecElms", u64(1)) + field(b"bknd", backend) + field(b"nixlDList", b"nixlSDList")
            + field(b"t", mem.to_bytes(4, "little")) + field(b"n", u64(len(descs))) + b"".join(field(b"", d) for d in descs))


def desc(key: bytes = rkey(), length: int = 2112, device: int = 0) -> bytes:
    return struct.pack("<QQQ", 0x7F0000001000, length, device) + key


def check_first(data: bytes) -> metadata.PeerAgent:
    peer, _ = metadata.check_grant(data, LOCAL, False, None)
    return peer


def first(descs: int = 1) -> bytes:
    """A connection's first grant: the agent's connection info and `descs` descriptors."""
    return blob(sections=section([desc()] * descs))


PEER = check_first(first())


def test_a_first_grant_and_a_later_one_pass():
    assert PEER.name == "droidmesh-nixl-sender-1"
    assert metadata.check_grant(first(2), LOCAL, False, None)[1] == 2
    assert metadata.check_grant(blob(conns=[], sections=section([desc(), desc()])), LOCAL, False, PEER) == (PEER, 2)


@pytest.mark.parametrize("bad, match", [
    (b"\x02" + theirs()[1:], "unknown version"),  # UCX aborts on this one
    (theirs()[:-3], "UCX worker address"),
])
def test_a_first_grant_whose_worker_address_ucx_would_abort_on_is_refused(bad, match):
    with pytest.raises(BadMessageError, match=match):
        check_first(blob(conns=[bad], sections=section([desc()])))


@pytest.mark.parametrize("bad", [
    blob(conns=[], sections=section([desc()])),  # no connection
    blob(conns=[theirs()] * 2, sections=section([desc()])),  # two
    blob(backend=b"GDS", sections=section([desc()])),
    blob(name=b"", sections=section([desc()])),
    blob(name=b"\xff\xfe", sections=section([desc()])),
    blob(),  # a connection describing no memory
    first()[:-1],
    first() + b"x",
    b"nixlSerDez|" + first()[11:],
])
def test_first_grants_of_another_shape_are_refused(bad):
    with pytest.raises(BadMessageError):
        check_first(bad)


@pytest.mark.parametrize("bad", [
    blob(name=b"someone-else", conns=[], sections=section([desc()])),
    blob(sections=section([desc()])),  # a later grant carrying a connection
    blob(conns=[], sections=section([desc()], mem=1)),  # device memory
    blob(conns=[], sections=section([desc()], backend=b"POSIX")),
    blob(conns=[], sections=section([desc(device=1)])),
    blob(conns=[], sections=section([desc(length=0)])),
    blob(conns=[], sections=section([desc(key=rkey(mem_type=2))])),
    blob(conns=[], sections=section([desc(key=rkey(md_map=1 << 3))])),  # posix's FIFO domain
    blob(conns=[], sections=section([desc()[:20]])),
    blob(conns=[], sections=field(b"nixlSecElms", u64(2**63))),
    blob(conns=[], sections=section([desc()]))[:-2],
])
def test_later_grants_of_another_shape_are_refused(bad):
    with pytest.raises(BadMessageError):
        metadata.check_grant(bad, LOCAL, False, PEER)


def test_device_memory_descriptors_pass_only_when_device_memory_was_asked_for():
    """A VRAM section (a GPU sender's: cuda_copy and an InfiniBand HCA) passes a receiver that asked
    for device memory, with its keys checked as device keys; a host receiver refuses it, and a
    device receiver refuses host descriptors and device ids past a GPU index."""
    gpu = pack([(0, b"", [(ucp_rkey.CUDA_COPY, b"")]), (2, b"\x01\x00", [(crc16("rc_mlx5"), b"\x00" * 3)])])
    device_key = struct.pack("<QB", 0b101, 1) + b"\x00" + b"\x08" + b"\x11" * 8 + b"\xff"
    grant = blob(conns=[gpu], sections=section([desc(key=device_key, device=3)] * 2, mem=1))
    assert metadata.check_grant(grant, LOCAL, False, None, "cuda", own_pid=1)[1] == 2
    with pytest.raises(BadMessageError, match="memory kind 1; host memory"):
        metadata.check_grant(grant, LOCAL, False, None)
    with pytest.raises(BadMessageError, match="memory kind 0; cuda memory"):
        metadata.check_grant(first(), LOCAL, False, None, "cuda")
    with pytest.raises(BadMessageError, match="on device 64"):
        metadata.check_grant(blob(conns=[gpu], sections=section([desc(key=device_key, device=64)], mem=1)),
                             LOCAL, False, None, "cuda")
    short = struct.pack("<QB", 0b101, 1) + b"\x00" + b"\x07" + b"\x11" * 7 + b"\xff"  # the HCA's key a byte short
    with pytest.raises(BadMessageError, match="misread"):
        metadata.check_grant(blob(conns=[gpu], sections=section([desc(key=short)], mem=1)), LOCAL, False, None, "cuda")


@pytest.mark.fuzz
@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, 600), junk=st.binary(max_size=12))
def test_mangled_metadata_parses_or_raises_bad_message(cut, junk):
    later = blob(conns=[], sections=section([desc(), desc()]))
    for data in (first()[:cut] + junk + first()[cut + len(junk):], later[:cut] + junk + later[cut + len(junk):]):
        try:
            check_first(data)
        except BadMessageError:
            pass
        try:
            metadata.check_grant(data, LOCAL, False, PEER)
        except BadMessageError:
            pass
