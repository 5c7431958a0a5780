"""The bulk channels' own control messages, besides the pull protocol in `schemas`.

`SenderEndpoint` rides the bus; the others ride each channel's own control stream around a
`PullRequest` / `PullResponse`: NIXL's and shm's grants and dones, the UCX wire-up's welcome.
Encoded and decoded by `schemas.encode` / `schemas.decode` on the channel's event loop; decoding
checks every field's type and bound, nothing more: a grant is checked against the request by the
channel's client.
"""

from __future__ import annotations

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
    """Where one granted item lies in the grant's memfds: row r of the item (a K / V head, or E's
    one row) starts at `offset + r * stride` of memfd number `fd`; the receiver derives the rows
    and their length from its own buffer."""

    fd: int
    offset: int
    stride: int


class ShmGrant(Message, tag="shm.grant"):
    """The sender's answer to a PullRequest. Granted: the headers, one region per item and
    `fds` memfds passed with this frame (SCM_RIGHTS). Refused: an error in `response`, no
    regions and no memfds."""

    response: PullResponse
    regions: list[ShmRegion] = []
    fds: int = 0


class ShmDone(Message, tag="shm.done"):
    """Receiver -> sender: the granted reads are over; the sender may release what it held."""
