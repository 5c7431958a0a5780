"""The process's ucxx: initialised once with DroidMesh's UCX options, and what follows from them
(which network devices UCX may use, whether CUDA memory goes to UCX as it is).

ucxx is imported on first use (`ucxx()`), and UCX is configured through `ucxx.init` options,
never by changing the process environment; `UCX_*` variables set by an operator still win.
Called on the event loop by the UCX channel's server and client, and by `capabilities.py`;
`ucxx()` blocks for UCX's initialisation the first time (well under a second).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import torch

from droidmesh.shared.transport import capabilities, codecs
from droidmesh.shared.transport.address import local_ipv4s
from droidmesh.shared.transport.ucp_address import LocalView
from droidmesh.shared.transport.ucx import worker
from droidmesh.shared.wire.schemas import PullRequest

log = structlog.get_logger("ucx")
# Listener endpoints always run with peer-failure error handling (ucxx cannot accept a connection
# without it), and under it UCX only takes a transport for zero-copy rendezvous if its memory
# domain can invalidate memory (ucp_wireup.c; "for data integrity in case of error"). CMA's
# domain never claims that, so same-host bulk went through TCP on loopback (and posix/sysv are
# dropped too unless MM_ERROR_HANDLING=y). CMA_MEMORY_INVALIDATE=y only declares the capability,
# which makes rendezvous "zero-copy read from remote" over CMA eligible: the receiver's own thread
# copies the sender's payload into its buffer with process_vm_readv (one copy, no bounce buffer).
# What the missing invalidation could cost after a peer failure is a read of a sender buffer the
# sender already reused; those bytes fail the payload checksum. MM_ERROR_HANDLING=y (sysv
# fragments for the bulk) is left off: each 512 KiB fragment needs both processes scheduled at
# once, which a busy host does not give.
UCX_OPTIONS = {"TLS": "tcp,sm,self", "CMA_MEMORY_INVALIDATE": "y", "WARN_UNUSED_ENV_VARS": "n"}
# With a GPU, UCX may move device memory itself (cuda_copy; cuda_ipc between processes on one
# node, see capabilities.py). Named only where CUDA exists: UCX warns about absent transports.
CUDA_TLS = "cuda_copy,cuda_ipc"
_net_devices: str | None = None  # UCX_NET_DEVICES for ucxx.init, set by the first server (bind_devices)


def ucx_options() -> dict[str, str]:
    """`UCX_OPTIONS`, plus the CUDA transports on a machine that has a GPU and the network devices
    a server restricted UCX to (`bind_devices`)."""
    options = dict(UCX_OPTIONS)
    if torch.cuda.is_available():
        options["TLS"] = f"{UCX_OPTIONS['TLS']},{CUDA_TLS}"
    if _net_devices:
        options["NET_DEVICES"] = _net_devices
    return options


def ucxx() -> Any:
    """The ucxx module, initialised once with DroidMesh's UCX options (`worker.py`)."""
    return worker.ucxx(ucx_options())


def local_view() -> LocalView:
    """This process's UCX transports and address shapes (`worker.local_view`)."""
    return worker.local_view(ucx_options())


def host_devices(host: str) -> str | None:
    """The network device(s) holding `host`'s IPv4 address ("lo" for loopback), comma-separated;
    None when that cannot be told (a name that does not resolve to IPv4, IPv6, a wildcard)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    return ",".join(local_ipv4s().get(str(ip), [])) or None


def bind_devices(host: str) -> None:
    """Restrict UCX's network transports to the device(s) holding `host` when ucxx is not yet
    initialised (else, or when the devices cannot be told, log that UCX's tcp transport may
    listen on other devices too)."""
    global _net_devices
    devices = host_devices(host)
    if not worker.initialised() and devices is not None:
        _net_devices = devices
    if _net_devices is None or _net_devices != devices:
        log.warning("ucx_devices_unrestricted", configured=host, devices=_net_devices or "all",
                    effect="UCX's tcp transport listens on every device it uses; firewall it or use a private network")


def net_devices() -> str:
    return _net_devices or "all"


def ask_device(request: PullRequest, into: Sequence[torch.Tensor]) -> PullRequest:
    """The request as a client sends it: asking for device payloads when every buffer is on CUDA
    and UCX here takes device memory (else, with CUDA buffers, noting once that it stages)."""
    if request.codec != "raw" or not into or not all(b.device.type == "cuda" for b in into):
        return request
    support = capabilities.ucx_cuda_support()
    if not support.device_memory:
        capabilities.note_staging("receiver", support)
        return request
    return msgspec.structs.replace(request, codec_params={**request.codec_params, codecs.DEVICE_PARAM: "cuda"})


def honour_device(request: PullRequest) -> PullRequest:
    """The request as a server answers it: without the ask for device payloads where UCX here
    cannot send device memory (its CUDA tensors then go as pinned host copies)."""
    if not codecs.asks_device(request.codec_params):
        return request
    support = capabilities.ucx_cuda_support()
    if support.device_memory:
        return request
    if torch.cuda.is_available():  # without CUDA this sender holds no CUDA tensors: nothing is staged
        capabilities.note_staging("sender", support)
    params = {k: v for k, v in request.codec_params.items() if k != codecs.DEVICE_PARAM}
    return msgspec.structs.replace(request, codec_params=params)
