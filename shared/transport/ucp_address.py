"""UCX's packed worker address a peer hands us (the UCX channel's hello, the connection info inside
a NIXL agent's metadata), checked before UCX parses it; `ucp_rkey.py` checks the remote keys of a
NIXL grant's memory descriptors against it.

Why: UCX parses both without a length and trusts every byte. `ucp_address_unpack` asserts on a
header whose version nibble is neither v1 nor v2 (the process aborts: SIGABRT, no Python
exception), follows length bytes past the end of the buffer, indexes a 64-entry array with a
peer's memory-domain index; each transport then reads its device and interface addresses at the
length it expects, not the length the peer declared. `ucp_ep_rkey_unpack` likewise walks a key
by its own map. So a peer's bytes reach ucxx / NIXL only once `parse_worker_address` has walked
them exactly as UCX will (every length within the buffer, nothing left over) and `check_peer`
has matched every entry UCX could pair with one of our transports against the shapes that
transport reads.

Pure functions of bytes (no ucxx, no NIXL): the UCX channel's wireup and the NIXL client call
them on the event loop before any UCX call. What they trust: our own worker address (UCX packed
it) as the reference of which transports run here and the shapes they use; nothing of the peer.
Written against UCX 1.21-1.23's format (non-unified mode, address v1 and v2); an address of ours
that does not parse (another format, `UCX_UNIFIED_MODE=y`) makes `LocalView.of` raise, so no peer
is ever wired up unchecked.
"""

from __future__ import annotations

import dataclasses
import math
import struct

from droidmesh.shared.errors import BadMessageError

MAX_WORKER_ADDRESS = 8192  # ours is ~200 bytes; UCX's own bound on resources keeps any real one far below
MAX_RESOURCES = 128  # UCP_MAX_RESOURCES: address entries UCX unpacks
MAX_MDS = 64  # UCP_MAX_MDS: UCX indexes per-md arrays of this size with a peer's md index
MAX_LANES = 64
UNKNOWN_SYS_DEV = 0xFF
NULL_RESOURCE = 0xFF  # an address with no device at all

_V1, _V2 = 0, 1  # the header's low nibble (UCP_OBJECT_VERSION_V1 / _V2); anything else aborts UCX
_HDR_DEBUG, _HDR_UUID, _HDR_CLIENT_ID, _HDR_AM_ONLY = 1, 2, 4, 8
_LAST, _HAS_EP, _NUM_PATHS, _SYS_DEV, _EMPTY_DEV = 0x80, 0x40, 0x40, 0x20, 0x80


def crc16(name: str) -> int:
    """UCX's checksum of a transport name (`ucs_crc16_string`, CRC-16-CCITT reflected)."""
    crc = 0xFFFF
    for b in name.encode():
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


TCP, SELF, POSIX, SYSV, CMA = (crc16(n) for n in ("tcp", "self", "posix", "sysv", "cma"))
# Same-host transports: their device address names the host (and IPC namespace) they run on.
SHARED_MEMORY = frozenset(crc16(n) for n in ("posix", "sysv", "cma", "xpmem", "knem", "cuda_ipc"))
_POSIX_PID_NS = 1 << 60  # UCT_POSIX_SEG_FLAG_PID_NS in a posix FIFO's segment id
_CMA_PID_NS = 1 << 31  # UCT_CMA_IFACE_ADDR_FLAG_PID_NS in a cma interface address
_LOCAL_NS = 1 << 63  # UCT_IFACE_LOCAL_ADDR_FLAG_NS: a host id extended by a namespace id
_NS_BYTES = (4, 8)  # a namespace id: an inode (8 bytes) up to UCX 1.21, a 32-bit id from 1.22 on


@dataclasses.dataclass(frozen=True)
class Entry:
    """One transport interface of an address (UCX's `ucp_address_entry_t`, as packed)."""

    tl: int  # crc16 of the transport's name
    md: int  # the peer's memory-domain index
    dev: bytes  # device address
    iface: bytes  # interface address
    sys_dev: int
    paths: int
    window: bytes = b""  # the address from `dev` on, up to 18 bytes: a transport reads its own length, not `dev`'s

    def host_window(self) -> bytes | None:
        """The bytes a same-host transport (or tcp over loopback) reads as this entry's host and
        namespace identity; None for other entries."""
        if self.tl in SHARED_MEMORY:
            return self.window[:16]
        if self.tl == TCP and self.dev[:1] == b"\x01":
            return self.window[2:18]
        return None


@dataclasses.dataclass(frozen=True)
class WorkerAddress:
    version: int  # _V1 or _V2
    entries: tuple[Entry, ...]


class Reader:
    def __init__(self, buf: bytes, what: str):
        self.buf, self.at, self.what = buf, 0, what

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.buf):
            raise BadMessageError(f"{self.what} ends inside a field ({n} bytes at {self.at} of {len(self.buf)})")
        self.at += n
        return self.buf[self.at - n:self.at]

    def u8(self) -> int:
        return self.take(1)[0]

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def done(self) -> None:
        if self.at != len(self.buf):
            raise BadMessageError(f"{self.what} has {len(self.buf) - self.at} bytes after its end")


def _extended(r: Reader, value: int, mask: int, version: int) -> int:
    """A v2 length or index that saturates its bit field continues in the next byte."""
    return r.u8() if version == _V2 and value == mask else value


def parse_worker_address(buf: bytes) -> WorkerAddress:
    """Walk `buf` as `ucp_address_unpack` will (with `ucp_ep_create`'s flags) and return its
    entries; `BadMessageError` for anything UCX would abort on, read past, or misindex."""
    if not 0 < len(buf) <= MAX_WORKER_ADDRESS:
        raise BadMessageError(f"a {len(buf)}-byte UCX worker address; at most {MAX_WORKER_ADDRESS}")
    r = Reader(buf, "UCX worker address")
    header = r.u8()
    version = header & 0xF
    if version not in (_V1, _V2):
        raise BadMessageError(f"UCX worker address of unknown version {version} (UCX aborts on it)")
    flags = header >> 4 if version == _V1 else r.u8()
    if flags & ~0xF:
        raise BadMessageError(f"UCX worker address header flags {flags:#x}")
    if version == _V1 or flags & _HDR_UUID:  # v1: the uuid is always there
        r.take(8)
    if flags & _HDR_CLIENT_ID:
        r.take(8)
    if flags & _HDR_DEBUG:
        r.take(r.u8())  # the worker's name
    if r.at < len(buf) and buf[r.at] == NULL_RESOURCE:
        r.take(1)
        r.done()
        return WorkerAddress(version, ())
    entries: list[Entry] = []
    for _ in range(MAX_RESOURCES + 1):  # devices: each has >= 1 entry but the last (a release marker)
        md_byte = r.u8()
        empty, md = md_byte & _EMPTY_DEV, _extended(r, md_byte & 0x7F, 0x7F, version)
        dev_byte = r.u8()
        last, dev_len = dev_byte & _LAST, _extended(r, dev_byte & 0x1F, 0x1F, version)
        paths = r.u8() if dev_byte & _NUM_PATHS else 1
        sys_dev = r.u8() if dev_byte & _SYS_DEV else UNKNOWN_SYS_DEV
        dev_at, dev = r.at, r.take(dev_len)
        if not (empty and last):  # the last empty device carries UCX's release version, not an md
            if md >= MAX_MDS:
                raise BadMessageError(f"UCX worker address names memory domain {md}; at most {MAX_MDS - 1}")
            if not 1 <= paths <= MAX_LANES or not (sys_dev < 64 or sys_dev == UNKNOWN_SYS_DEV):
                raise BadMessageError(f"UCX worker address device with {paths} paths, system device {sys_dev}")
        while not empty:
            tl = r.unpack("<H")[0]
            _check_attr(r.take(16 if version == _V1 else 8), version)
            tl_byte = r.u8()
            if tl_byte & _HAS_EP:
                raise BadMessageError("UCX worker address with endpoint addresses (a worker's has none)")
            iface = r.take(_extended(r, tl_byte & 0x3F, 0x3F, version))
            entries.append(Entry(tl, md, dev, iface, sys_dev, paths, buf[dev_at:dev_at + 18]))
            if len(entries) > MAX_RESOURCES:
                raise BadMessageError(f"UCX worker address with more than {MAX_RESOURCES} interfaces")
            empty = tl_byte & _LAST
        if last:
            r.done()
            return WorkerAddress(version, tuple(entries))
    raise BadMessageError(f"UCX worker address with more than {MAX_RESOURCES} devices")


def _check_attr(attr: bytes, version: int) -> None:
    """An interface's performance attributes: finite, bandwidth positive (UCX divides by them)."""
    if version == _V1:
        overhead, bandwidth, latency, _ = struct.unpack("<fffI", attr)
        if not all(math.isfinite(x) and x >= 0 for x in (overhead, bandwidth, latency)) or bandwidth == 0:
            raise BadMessageError("UCX worker address with a non-finite or non-positive interface attribute")
    elif any(b & 0xF == 0xF for b in attr[:3]) or attr[1] & 0xF == 0:  # fp8: exponent 0xF is NaN, 0 is zero
        raise BadMessageError("UCX worker address with a NaN or zero interface attribute")


@dataclasses.dataclass(frozen=True)
class LocalView:
    """What our own worker address says UCX here would pair a peer's entry with."""

    shapes: dict[int, frozenset[tuple[int, int]]]  # transport -> (device, interface) address lengths
    hosts: dict[int, frozenset[bytes]]  # transport -> our host identities (`Entry.host_id`, at their own length)
    self_ifaces: frozenset[bytes]

    @classmethod
    def of(cls, own: bytes) -> LocalView:
        """From our own packed worker address; `BadMessageError` where we cannot read it."""
        try:
            entries = parse_worker_address(own).entries
        except BadMessageError as err:
            raise BadMessageError(f"this UCX's own worker address does not parse ({err}); refusing to wire up "
                                  "peers whose addresses could not be checked") from None
        shapes: dict[int, set[tuple[int, int]]] = {}
        hosts: dict[int, set[bytes]] = {}
        for e in entries:
            shapes.setdefault(e.tl, set()).add((len(e.dev), len(e.iface)))
            if e.host_window() is not None:
                hosts.setdefault(e.tl, set()).add(e.dev[2:] if e.tl == TCP else e.dev)
        return cls({k: frozenset(v) for k, v in shapes.items()}, {k: frozenset(v) for k, v in hosts.items()},
                   frozenset(e.iface for e in entries if e.tl == SELF))


def check_peer(address: bytes, local: LocalView, peer_on_this_host: bool) -> WorkerAddress:
    """Parse a peer's worker address and check every entry UCX here could pair with one of our
    transports: its addresses have the shape that transport reads. A peer that is not on this
    host may not claim to share it (our host and namespace identity in a shared-memory or
    loopback-tcp entry, our own loopback id): UCX would map the segments, read the process or dial
    the local port it names. Returns the parsed address."""
    parsed = parse_worker_address(address)
    for e in parsed.entries:
        known = local.shapes.get(e.tl)
        if known is None:
            continue  # no transport of that name here: UCX never hands it to one
        _check_shape(e, known)
        window = e.host_window()
        claims_host = window is not None and any(window[:len(h)] == h for h in local.hosts.get(e.tl, ()))
        if not peer_on_this_host and (claims_host or e.tl == SELF and e.iface in local.self_ifaces):
            raise BadMessageError(f"a peer that is not on this host claims to share it (transport {e.tl:#06x})")
    return parsed


def _local_id(dev: bytes) -> bool:
    """A host id (8 bytes), or one extended by a namespace id when its top bit says so."""
    if len(dev) < 8:
        return False
    return len(dev) - 8 in (_NS_BYTES if int.from_bytes(dev[:8], "little") & _LOCAL_NS else (0,))


def _check_shape(e: Entry, known: frozenset[tuple[int, int]]) -> None:
    bad = BadMessageError(f"UCX worker address entry for transport {e.tl:#06x} with a {len(e.dev)}-byte device and "
                          f"{len(e.iface)}-byte interface address UCX would misread")
    if e.tl == TCP:  # flags, family, then an IPv4 / IPv6 address or (loopback) a host id
        if len(e.dev) < 2 or e.dev[0] & ~1 or len(e.iface) != 2:
            raise bad
        if e.dev[0] & 1:
            ok = _local_id(e.dev[2:])
        else:
            ok = len(e.dev) - 2 == {2: 4, 10: 16}.get(e.dev[1], -1)
    elif e.tl in (POSIX, SYSV, CMA):
        seg = int.from_bytes(e.iface[:8], "little") if len(e.iface) >= 8 else 0
        ok = _local_id(e.dev) and {
            # a FIFO's segment id, then its pid namespace id or (a file-backed FIFO) a directory path
            POSIX: len(e.iface) - 8 in _NS_BYTES if seg & _POSIX_PID_NS else len(e.iface) == 8 or (
                len(e.iface) > 8 and e.iface.find(b"\0", 8) == len(e.iface) - 1),
            SYSV: len(e.iface) == 8,
            # a pid, then (flagged) its namespace id, 8-aligned when that was an inode
            CMA: len(e.iface) in ((8, 16) if int.from_bytes(e.iface[:4], "little") & _CMA_PID_NS else (4,)),
        }[e.tl]
    else:
        ok = (len(e.dev), len(e.iface)) in known
    if not ok:
        raise bad
