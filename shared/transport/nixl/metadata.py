"""A sender's NIXL agent metadata, checked before the receiver's agent loads it.

`nixlAgent::loadRemoteMD` hands what it finds to its UCX backend: the connection info is the
sender's UCX worker address (`ucp_ep_create` parses it, and aborts the process on a malformed
one), and every memory descriptor carries a packed UCP remote key (`ucp_ep_rkey_unpack` walks it
without a length). So the receiver walks the whole blob here first, exactly as NIXL serialises
it (nixlSerDes: "nixlSerDes|", then per field its tag, a little-endian u64 length, the bytes and
"|"), and accepts only the shape a DroidMesh sender produces (`check_grant`, a NixlGrant's metadata):
the agent's name, its UCX connection (its worker address checked by `ucp_address.check_peer`) on
a connection's first grant and none after, then one UCX section of descriptors of the memory the
receiver asked for (host memory, which the channel serves today, or device memory), each remote
key checked by `ucp_rkey.check_rkey` against that worker address.
Anything else is `BadMessageError`, before NIXL sees a byte. Pure functions of bytes, called on
the receiver's event loop by `client.py`.
"""

from __future__ import annotations

import dataclasses
import struct

from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.transport.bulk import MAX_ITEMS
from droidmesh.shared.transport.ucp_address import LocalView, WorkerAddress, check_peer
from droidmesh.shared.transport.ucp_rkey import Memory, check_rkey

MAGIC = b"nixlSerDes|"
MAX_AGENT_NAME = 256
SEGMENTS: dict[Memory, int] = {"host": 0, "cuda": 1}  # nixl_mem_t: DRAM_SEG, VRAM_SEG
MAX_DEVICE = 64  # a VRAM descriptor's device id: a GPU index
_DESC = struct.Struct("<QQQ")  # nixlBasicDesc: address, length, device id


@dataclasses.dataclass(frozen=True)
class PeerAgent:
    """The agent a connection's first grant names (the sender's sandbox for it), checked."""

    name: str
    address: WorkerAddress  # its UCX worker address, parsed


class _Fields:
    def __init__(self, blob: bytes):
        if not blob.startswith(MAGIC):
            raise BadMessageError("NIXL metadata without its nixlSerDes tag")
        self.blob, self.at = blob, len(MAGIC)

    def get(self, tag: bytes, size: int | None = None) -> bytes:
        """The next field, which must be tagged `tag` (and `size` bytes long when given)."""
        head = self.at + len(tag) + 8
        if self.blob[self.at:self.at + len(tag)] != tag or head > len(self.blob):
            raise BadMessageError(f"NIXL metadata: no {tag.decode()!r} field at {self.at}")
        n = int.from_bytes(self.blob[head - 8:head], "little")
        if n > len(self.blob) - head - 1 or self.blob[head + n:head + n + 1] != b"|" or size not in (None, n):
            raise BadMessageError(f"NIXL metadata: field {tag.decode()!r} of {n} bytes does not fit")
        self.at = head + n + 1
        return self.blob[head:head + n]

    def count(self, tag: bytes, most: int) -> int:
        n = int.from_bytes(self.get(tag, 8), "little")
        if n > most:
            raise BadMessageError(f"NIXL metadata: {n} {tag.decode()!r}; at most {most}")
        return n

    def done(self) -> None:
        if self.at != len(self.blob):
            raise BadMessageError(f"NIXL metadata has {len(self.blob) - self.at} bytes after its end")


def _head(blob: bytes, conns: int) -> tuple[_Fields, str, list[bytes]]:
    """The agent's name and its `conns` UCX connection infos (exactly that many)."""
    f = _Fields(blob)
    try:
        name = f.get(b"Agent").decode()
    except UnicodeDecodeError:
        raise BadMessageError("NIXL metadata: an agent name that is not UTF-8") from None
    if not 0 < len(name) <= MAX_AGENT_NAME:
        raise BadMessageError(f"NIXL metadata: a {len(name)}-character agent name")
    if f.count(b"Conns", conns) != conns:
        raise BadMessageError(f"NIXL metadata: not {conns} connections")
    infos = []
    for _ in range(conns):
        if f.get(b"t") != b"UCX":
            raise BadMessageError("NIXL metadata: a connection of a backend other than UCX")
        infos.append(f.get(b"c"))
    if f.get(b"") != b"MemSection":
        raise BadMessageError("NIXL metadata: no memory section")
    return f, name, infos


def own_address(blob: bytes) -> bytes:
    """The UCX worker address in our own agent's connection metadata (the reference a sender's
    is checked against)."""
    _, _, (info,) = _head(blob, 1)
    return info


def check_grant(blob: bytes, local: LocalView, peer_on_this_host: bool, known: PeerAgent | None,
                memory: Memory = "host", own_pid: int = -1) -> tuple[PeerAgent, int]:
    """A grant's metadata: descriptors of one agent's `memory` (host: NIXL's DRAM; cuda: its VRAM,
    on a device below MAX_DEVICE), nothing else; the connection's first (`known` None) also
    carries that agent's UCX connection info (its worker address checked by `check_peer`), every
    later one none and the same agent's name. Every descriptor's remote key is checked by
    `ucp_rkey.check_rkey` for that memory (`own_pid`: this process's). Returns the agent and how
    many descriptors it describes."""
    f, name, infos = _head(blob, 1 if known is None else 0)
    if known is not None and name != known.name:
        raise BadMessageError(f"NIXL grant metadata of agent {name[:80]!r}, not of the connected {known.name!r}")
    peer = known or PeerAgent(name, check_peer(infos[0], local, peer_on_this_host))
    if f.count(b"nixlSecElms", 1) != 1 or f.get(b"bknd") != b"UCX" or f.get(b"nixlDList") != b"nixlSDList":
        raise BadMessageError("NIXL grant metadata: not one UCX section of descriptors")
    segment = int.from_bytes(f.get(b"t", 4), "little")
    if segment != SEGMENTS[memory]:
        raise BadMessageError(f"NIXL grant metadata: descriptors of memory kind {segment}; {memory} memory "
                              f"({SEGMENTS[memory]}) only")
    n = f.count(b"n", MAX_ITEMS)
    for _ in range(n):
        desc = f.get(b"")
        if len(desc) < _DESC.size:
            raise BadMessageError(f"NIXL grant metadata: a {len(desc)}-byte descriptor")
        _, length, device = _DESC.unpack_from(desc)
        if length == 0 or (device != 0 if memory == "host" else device >= MAX_DEVICE):
            raise BadMessageError(f"NIXL grant metadata: a descriptor of {length} bytes on device {device}")
        check_rkey(desc[_DESC.size:], peer.address, memory, on_this_host=peer_on_this_host, own_pid=own_pid)
    f.done()
    return peer, n
