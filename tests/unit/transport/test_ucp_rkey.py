"""Remote keys for device memory (a NIXL VRAM registration's) are walked and checked before UCX
sees them: each memory domain's key at the size its component reads, nothing UCX would act on
against us (our own pid, a BAR pointer, a peer's file descriptor), the distance list ending where
the key does. Keys built as UCX 1.21-1.23 packs them (`ucp_rkey_pack_memh`, `uct_cuda_ipc_rkey_t`)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport import ucp_address as ua
from droidmesh.shared.transport import ucp_rkey as rk
from tests.unit.transport.test_ucp_address import HOST, pack

OWN_PID = 4242
# a GPU sender's address: md 0 cuda_copy, 1 cuda_ipc, 2 an InfiniBand HCA, 3 gdr_copy, 4 sysv, 5 cma
PEER = ua.parse_worker_address(pack([(0, b"", [(rk.CUDA_COPY, b"")]),
                                     (1, HOST, [(rk.CUDA_IPC, bytes(8))]),
                                     (2, b"\x01\x00", [(ua.crc16("rc_mlx5"), b"\x00" * 3), (ua.crc16("dc_mlx5"), b"\x00" * 3)]),
                                     (3, b"", [(rk.GDR_COPY, bytes(8))]),
                                     (4, HOST, [(ua.SYSV, bytes(8))]),
                                     (5, HOST, [(ua.CMA, b"xN\x00\x00")])]))


def ipc(handle: int = 1, pid: int = 1234, base: int = 0x7F0000000000, length: int = 1 << 26, ns: bool = False) -> bytes:
    """A cuda_ipc md's key: handle type, handle union and pool data, pid, buffer, GPU uuid (+ pid namespace)."""
    out = bytearray(rk.IPC_KEY_NS if ns else rk.IPC_KEY)
    struct.pack_into("<I", out, 0, handle)
    struct.pack_into("<I", out, 152, pid | (1 << 31 if ns else 0))
    struct.pack_into("<QQ", out, 160, base, length)
    out[176:192] = b"\xab" * 16
    return bytes(out)


def key(mds: dict[int, bytes], mem_type: int = 1, tail: bytes = b"\x02\x00\x4a\x4b\x01\x4c\x4d\x02\x4e\x4f\xff") -> bytes:
    """md map, memory type, per md its length-prefixed key, then the system device (2, flushed or
    not) with its distances to devices 0, 1 and 2 and the terminator."""
    md_map = sum(1 << md for md in mds)
    return struct.pack("<QB", md_map, mem_type) + b"".join(bytes([len(mds[m])]) + mds[m] for m in sorted(mds)) + tail


GOOD = key({0: b"", 1: ipc(), 2: b"\x11" * 8})


def check(k: bytes, on_this_host: bool = True) -> None:
    rk.check_rkey(k, PEER, "cuda", on_this_host=on_this_host, own_pid=OWN_PID)


def test_a_device_key_as_ucx_packs_one_passes():
    check(GOOD)
    check(key({0: b"", 1: ipc(ns=True)}))  # a sender in its own pid namespace: the 200-byte key
    check(key({0: b""}, tail=b"\xff"))  # no system device: nothing after it
    check(key({0: b"", 2: b"\x11" * 8}, tail=b"\x82\x00\x01\x02\xff"), on_this_host=False)  # GPUDirect from elsewhere, flush flag


@pytest.mark.parametrize("bad, match", [
    (key({0: b""}, mem_type=0), "memory type 0"),
    (key({0: b""}, mem_type=2), "memory type 2"),  # VMM / stream-ordered: managed, no IPC path
    (key({0: b"\x00"}), "misread"),  # cuda_copy reads nothing
    (key({2: b"\x11" * 7}), "misread"),
    (key({1: ipc()[:191]}), "191-byte CUDA IPC key"),
    (key({1: ipc() + bytes(8)}), "disagree"),  # 200 bytes, the pid not flagged: UCX reads 192
    (key({1: ipc(ns=True)[:192]}), "disagree"),  # flagged, so UCX reads 8 more bytes than there are
    (key({1: ipc(handle=0)}), "handle type 0"),
    (key({1: ipc(handle=4)}), "handle type 4"),  # a POSIX fd: UCX would take it out of the peer's process
    (key({1: ipc(pid=OWN_PID)}), "naming this process"),
    (key({1: ipc(length=0)}), "0-byte buffer"),
    (key({1: ipc(base=(1 << 64) - 4096, length=8192)}), "8192-byte buffer"),
    (key({3: bytes(24)}), "never register"),  # gdr_copy: a BAR pointer the CPU would dereference
    (key({5: b""}), "never register"),
    (key({4: b""}), "does not offer"),
    (key({9: b""}), "does not offer"),
    (key({0: b""}, tail=b"\x40\xff"), "system device 64"),
    (key({0: b""}, tail=b"\x02\x01\x00\x00\x01\x00\x00\xff"), "after device 1"),  # not increasing
    (key({0: b""}, tail=b"\x02\x40\x00\x00\xff"), "device 64"),
    (key({0: b""}, tail=b"\x02\x00\x4a\x4b"), "ends inside"),  # no terminator: UCX reads on past the end
    (key({0: b""}, tail=b"\xff\x00"), "after its end"),
    (GOOD + b"\x00", "after its end"),
])
def test_device_keys_ucx_would_misread_or_act_on_are_refused(bad, match):
    with pytest.raises(BadMessageError, match=match):
        check(bad)


def test_a_cuda_ipc_key_from_another_host_is_refused():
    with pytest.raises(BadMessageError, match="another host"):
        check(key({0: b"", 1: ipc()}), on_this_host=False)


def test_a_device_key_is_no_host_key_and_a_host_key_no_device_key():
    with pytest.raises(BadMessageError, match="memory type 1"):
        rk.check_rkey(GOOD, PEER, "host")
    with pytest.raises(BadMessageError, match="memory type 0"):
        check(struct.pack("<QB", 1 << 5, 0) + b"\x00\xff")


def test_every_truncation_of_a_device_key_is_refused():
    for n in range(len(GOOD)):
        with pytest.raises(BadMessageError):
            check(GOOD[:n])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_pass_or_raise_bad_message(data):
    try:
        check(data)
    except BadMessageError:
        pass
