"""A peer's packed UCP remote key (the memory descriptors of a NIXL grant), checked before UCX
parses it.

Why: `ucp_ep_rkey_unpack` walks a key without a length (NIXL hands it the bytes alone). It reads
the md map and the memory type, then per md bit a length byte that only moves its cursor while
the md's component reads its own fixed size, then a system device; when that names a device, it
reads 3-byte distance entries until a 0xFF byte, however far that is. Which component reads each
md's bytes is named by the peer's worker address (its md index), so a key is checked against that
address, already checked by `ucp_address.check_peer`.

Host memory (what the nixl channel reads today): md map, memory type 0, one length-prefixed key
per md the peer's address offers (not a shared-memory FIFO's: a key there names a segment UCX
would map; registering host memory never makes one), system device 0xFF, nothing after. A key of
no md (UCX over TCP alone, whose reads are emulated by messages) is the map and the type only.

Device memory (CUDA, `memory="cuda"`; the shape a NIXL VRAM registration packs, read from UCX
1.21-1.23's `ucp_rkey_pack_memh` and the CUDA components' `mkey_pack`; not yet compared with keys
a GPU made): memory type 1 only (UCX types VMM and stream-ordered allocations as managed, 2,
with no IPC path: refused). Each md's key has the exact size its component reads: cuda_copy 0,
an InfiniBand md (GPUDirect) 8, cuda_ipc 192 (200 when its pid is flagged with a namespace)
with a handle type of a legacy, VMM or memory-pool handle, a pid that is not ours (UCX would
then use the peer's device address as ours, unmapped) and a buffer that does not wrap; cuda_ipc
only from a peer on this host. gdr_copy (a peer's BAR pointer the CPU would dereference), POSIX
fd handles (the receiver would take a descriptor out of the peer's process) and any other md
are refused. Then the system device: 0xFF and the end, or a device below 64 (the flush flag
aside) and distance entries of strictly increasing devices below 64, then 0xFF and the end.
Pure functions of bytes, called on the receiver's event loop before any UCX or NIXL call.
"""

from __future__ import annotations

import struct
from typing import Literal

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport.ucp_address import MAX_MDS, POSIX, SYSV, UNKNOWN_SYS_DEV, Reader, WorkerAddress, crc16

MAX_RKEY = 4096
Memory = Literal["host", "cuda"]
HOST_MEM, CUDA_MEM = 0, 1  # UCS_MEMORY_TYPE_HOST, _CUDA (2, CUDA_MANAGED, has no IPC path)
CUDA_COPY, CUDA_IPC, GDR_COPY = (crc16(n) for n in ("cuda_copy", "cuda_ipc", "gdr_copy"))
# InfiniBand transports: an md of these registers device memory for GPUDirect (an 8-byte key)
IB = frozenset(crc16(n) for n in ("rc_verbs", "ud_verbs", "rc_mlx5", "dc_mlx5", "ud_mlx5", "gga_mlx5"))
IB_KEY = 8
IPC_KEY, IPC_KEY_NS = 192, 200  # uct_cuda_ipc_rkey_t; + its pid namespace when the pid is flagged
IPC_HANDLES = (1, 2, 3)  # legacy cudaIpc, VMM (fabric), memory pool; 0 is no handle, 4 a POSIX fd
_IPC_PID_NS = 1 << 31
_IPC_PID, _IPC_BUFFER = struct.Struct("<I"), struct.Struct("<QQ")  # at 152; d_bptr, b_len at 160
_FLUSH = 0x80  # UCP_SYS_DEVICE_FLUSH_BIT in the system device byte
MAX_SYS_DEVS = 64  # UCX keeps the devices a distance names in a 64-bit map


def check_rkey(key: bytes, peer: WorkerAddress, memory: Memory = "host", *, on_this_host: bool = True,
               own_pid: int = -1) -> None:
    """`key` as UCX would unpack it for `peer`, for `memory`; `BadMessageError` for anything else
    (see the module docstring). `own_pid`: this process's (a cuda_ipc key naming it is refused)."""
    if not 9 <= len(key) <= MAX_RKEY:
        raise BadMessageError(f"a {len(key)}-byte UCX remote key")
    r = Reader(key, "UCX remote key")
    md_map, mem_type = r.unpack("<QB")
    want = HOST_MEM if memory == "host" else CUDA_MEM
    if mem_type != want:
        raise BadMessageError(f"UCX remote key of memory type {mem_type}; {memory} memory ({want}) only")
    tls: dict[int, set[int]] = {}
    for e in peer.entries:
        tls.setdefault(e.md, set()).add(e.tl)
    for md in range(MAX_MDS):
        if md_map >> md & 1:
            if md not in tls or tls[md] <= {POSIX, SYSV}:
                raise BadMessageError(f"UCX remote key for memory domain {md}, which the peer's address does not offer")
            packed = r.take(r.u8())
            if memory == "cuda":
                _check_device_md(packed, tls[md], on_this_host, own_pid)
    if memory == "host":
        if md_map == 0 and len(key) == 9:
            return
        if r.u8() != UNKNOWN_SYS_DEV:
            raise BadMessageError("UCX remote key for host memory names a system device")
    else:
        _check_distances(r)
    r.done()


def _check_device_md(packed: bytes, tls: set[int], on_this_host: bool, own_pid: int) -> None:
    """One md's key of a device-memory remote key: the size its component reads, and for cuda_ipc
    what UCX would act on."""
    if tls == {CUDA_COPY}:
        ok = not packed
    elif tls and tls <= IB:
        ok = len(packed) == IB_KEY
    elif tls == {CUDA_IPC}:
        if not on_this_host:
            raise BadMessageError("UCX remote key with a CUDA IPC handle from a peer on another host")
        _check_ipc(packed, own_pid)
        return
    else:
        raise BadMessageError(f"UCX remote key for device memory in a memory domain of transports "
                              f"{sorted(f'{t:#06x}' for t in tls)}, which never register it here")
    if not ok:
        raise BadMessageError(f"UCX remote key for device memory with a {len(packed)}-byte key UCX would misread")


def _check_ipc(packed: bytes, own_pid: int) -> None:
    if len(packed) not in (IPC_KEY, IPC_KEY_NS):
        raise BadMessageError(f"a {len(packed)}-byte CUDA IPC key; UCX reads {IPC_KEY} or {IPC_KEY_NS}")
    handle = int.from_bytes(packed[:4], "little")
    (pid,) = _IPC_PID.unpack_from(packed, 152)
    base, length = _IPC_BUFFER.unpack_from(packed, 160)
    if handle not in IPC_HANDLES:
        raise BadMessageError(f"a CUDA IPC key of handle type {handle}; legacy, VMM or pool handles only")
    if (len(packed) == IPC_KEY_NS) != bool(pid & _IPC_PID_NS):
        raise BadMessageError("a CUDA IPC key whose size and pid namespace flag disagree")
    if pid & ~_IPC_PID_NS == own_pid:
        raise BadMessageError("a CUDA IPC key naming this process")
    if length == 0 or base + length > 1 << 64:
        raise BadMessageError(f"a CUDA IPC key of a {length}-byte buffer at {base:#x}")


def _check_distances(r: Reader) -> None:
    """A device key's system device, then (when it names one) its distance entries up to 0xFF."""
    sys_dev = r.u8()
    if sys_dev == UNKNOWN_SYS_DEV:
        return
    if sys_dev & ~_FLUSH >= MAX_SYS_DEVS:
        raise BadMessageError(f"UCX remote key naming system device {sys_dev & ~_FLUSH}; at most {MAX_SYS_DEVS - 1}")
    last = -1
    for _ in range(MAX_SYS_DEVS + 1):
        dev = r.u8()
        if dev == UNKNOWN_SYS_DEV:
            return
        if not last < dev < MAX_SYS_DEVS:
            raise BadMessageError(f"UCX remote key with a distance to device {dev} after device {last}")
        r.take(2)  # its latency and bandwidth, 8-bit floats
        last = dev
    raise BadMessageError(f"UCX remote key with more than {MAX_SYS_DEVS} distances")
