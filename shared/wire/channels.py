"""The bulk channels' own control messages, besides the pull protocol in `schemas`.

`SenderEndpoint` rides the bus; the others ride each channel's own control stream around a
`PullRequest` / `PullResponse`: NIXL's and shm's grants and dones, the UCX wire-up's welcome.
Encoded and decoded by `schemas.encode` / `schemas.decode` on the channel's event loop; decoding
checks every field's type and bound, nothing more: a grant is checked against the request by the
channel's client.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from droidmesh.shared.wire.schemas import Message, PullResponse, Transport


class SenderEndpoint(Message, tag="sender.endpoint"):
    """Where a sender's bulk channel listens, for receivers to connect ahead of a pull. Sent with
    each availability event, but without its context: receivers need no token ids to warm up."""

    sender_id: str
    model_id: str
    fingerprint_id: str
    transport: Transport
    address: str
    published_at: float  # unix seconds


# -- the NIXL pull's control exchange (a TCP stream beside NIXL's one-sided reads) ---------
# The first message on a connection is a PullRequest: nothing of the sender (no agent, no
# address, no memory) is described to a peer before it has shown a grant.
class NixlRegion(msgspec.Struct):
    """One granted payload's bytes in the sender's registered memory."""

    addr: int
    nbytes: int


class NixlGrant(Message, tag="nixl.grant"):
    """The sender's answer to a PullRequest. Granted: the headers, NIXL metadata for exactly the
    requested payloads' registrations (in the connection's sandbox process; the connection's
    first grant also carries that agent's connection info) and one region per item, in order.
    Refused: an error in `response` and no metadata or regions at all."""

    response: PullResponse
    metadata: bytes = b""
    regions: list[NixlRegion] = []


class NixlDone(Message, tag="nixl.done"):
    """Receiver -> sender: the granted reads are over; the sender may release what it held."""


# -- the UCX channel's wire-up (a TCP stream; the pulls then run over UCX endpoints) ------
class UcxWelcome(Message, tag="ucx.welcome"):
    """Sender -> receiver over the wire-up connection, answering the hello, which carries the
    connection's first PullRequest. Refused: `error`, and nothing of the sender. Granted: the
    UCX worker address of the connection's own sandbox process and its receive tag; that first
    pull's response and payloads then come over the endpoint."""

    error: str | None = None
    tag: int = 0
    address: bytes = b""


# -- the shm pull's control exchange (a Unix socket; the bytes are sealed memfds it passes) ----
class ShmRegion(msgspec.Struct):
    """Where one granted item lies: row r of the item (a K / V head, or E's one row) starts at
    `offset + r * stride` of memfd number `fd`, or, with `export` >= 0, of the grant's device
    export of that number (`fd` unused); the receiver derives the rows and their length from its
    own buffer."""

    fd: int
    offset: int
    stride: int
    export: int = -1


MAX_HANDLE_BYTES = 512  # a CUDA IPC export as `cuda_ipc` encodes it is ~200 bytes


class DeviceExport(msgspec.Struct):
    """A sender's device allocation a grant reads (`transport/exports.py`): its number within the
    sender's incarnation, its size and the handle a same-host receiver opens once."""

    export_id: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    handle: Annotated[bytes, msgspec.Meta(max_length=MAX_HANDLE_BYTES)]


class ShmGrant(Message, tag="shm.grant"):
    """The sender's answer to a PullRequest. Granted: the headers, one region per item, `fds`
    memfds passed with this frame (SCM_RIGHTS) and the device exports its regions read, with the
    sender's incarnation and the exports named on this connection that were released since its
    last grant (the receiver closes their mappings). `placed` numbers the passed memfds that hold
    a stored context (not a per-pull copy): a receiver may keep those mapped for later pulls until
    `released_memfds` names them (by inode: the memfds of this connection's grants whose context
    the sender has since let go). Refused: an error in `response`, no regions, no memfds and no
    exports."""

    response: PullResponse
    regions: list[ShmRegion] = []
    fds: int = 0
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""
    exports: list[DeviceExport] = []
    released: list[int] = []
    placed: list[int] = []
    released_memfds: list[int] = []


class ShmDone(Message, tag="shm.done"):
    """Receiver -> sender: the granted reads are over; the sender may release what it held."""
