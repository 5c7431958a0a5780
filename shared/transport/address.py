"""Bulk-channel addresses as a `CacheAvailable` carries them, and where a peer is.

Called by the channels' clients (before dialling) and by the UCX / NIXL wireup (to tell whether a
peer may claim this host's shared memory); pure, except `local_ipv4s`, which asks the kernel for
this host's interface addresses (a few ioctls, no blocking I/O). An address is the peer's word:
it is parsed, never trusted, and a bad one is a `TransferError` naming it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from droidmesh.shared.errors import TransferError

_SIOCGIFADDR = 0x8915
UNIX_PATH_MAX = 107  # sun_path's 108 bytes, less the terminating NUL


def parse_host_port(address: str, channel: str) -> tuple[str, int]:
    """"host:port" -> (host, port); `TransferError` for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad {channel} address {address!r}; expected host:port")
    return host, int(port)


def check_unix_path(address: str, channel: str) -> str:
    """A Unix socket's absolute path that fits `sun_path`; `TransferError` for anything else."""
    if not address.startswith("/") or "\0" in address or len(address.encode()) > UNIX_PATH_MAX:
        raise TransferError(f"bad {channel} address {address!r}; expected a Unix socket's absolute path")
    return address


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network device `name`, or None (no address, no such device)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def local_ipv4s() -> dict[str, list[str]]:
    """This host's IPv4 addresses -> the devices holding them."""
    found: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        ip = interface_ipv4(name)
        if ip is not None:
            found.setdefault(ip, []).append(name)
    return found


def on_this_host(peer: object) -> bool:
    """Whether a socket peer (`getpeername()`'s tuple, or None) is this host: a loopback address
    or one of this host's own. Unknown (None, a Unix socket's name) is not this host."""
    if not isinstance(peer, tuple) or not peer:
        return False
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or str(ip) in local_ipv4s()


def link_of(transport: str, address: str) -> str:
    """Where a holder sits, as a key for what pulls from there achieve: its host for a network
    channel ("ucx host"), this host for shm and in-process ones (the transport alone). Only a key:
    nothing is dialled or trusted by it."""
    if transport in ("shm", "inproc"):
        return transport
    host, sep, port = address.rpartition(":")
    return f"{transport} {host if sep and port.isdigit() else address}"
