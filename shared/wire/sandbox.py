"""The messages between a sender and its sandbox processes (`shared/transport/sandbox/`).

They travel over a Unix socket pair, one frame each, with the memfds of a grant passed beside
the frame (SCM_RIGHTS); `schemas.encode` / `schemas.decode` carry them like every other message.
The sender's side decodes `SandboxReport`s on its event loop; the sandbox decodes `SandboxOrder`s
on its own. Neither trusts the other's frames beyond their types: a sandbox serves peers it does
not trust, and the sender checks every report against what it ordered.
"""

from __future__ import annotations

import msgspec

from droidmesh.shared.wire.schemas import Message


class SandboxRegion(msgspec.Struct):
    """One payload: `nbytes` at `offset` of memfd number `fd` of its grant."""

    fd: int
    offset: int
    nbytes: int


class SandboxServe(Message, tag="sandbox.serve"):
    """Sender -> sandbox: one authorized pull, its encoded `PullResponse` and each payload's
    region in the `fds` memfds passed with this frame."""

    pull_id: int
    response: bytes
    regions: list[SandboxRegion]
    fds: int


class SandboxRelease(Message, tag="sandbox.release"):
    """Sender -> sandbox (nixl): the pull is over; unmap and deregister what it granted."""

    pull_id: int


class SandboxWire(Message, tag="sandbox.wire"):
    """Sender -> sandbox (ucx): a receiver's hello, to make the connection's endpoint from."""

    tag: int
    address: bytes
    on_this_host: bool


class SandboxReady(Message, tag="sandbox.ready"):
    """Sandbox -> sender: started, its transport library loaded (a warm spare)."""

    pid: int


class SandboxWired(Message, tag="sandbox.wired"):
    """Sandbox -> sender (ucx): the endpoint exists; the sandbox's worker address and receive tag."""

    tag: int
    address: bytes


class SandboxMapped(Message, tag="sandbox.mapped"):
    """Sandbox -> sender (nixl): the grant's payloads registered: their addresses there, and NIXL
    metadata for exactly those (with the agent's connection info on a connection's first)."""

    pull_id: int
    addrs: list[int]
    metadata: bytes


class SandboxServed(Message, tag="sandbox.served"):
    """Sandbox -> sender (ucx): the pull's response and payloads were sent (or why not)."""

    pull_id: int
    error: str | None = None


class SandboxAsk(Message, tag="sandbox.ask"):
    """Sandbox -> sender (ucx): the receiver's next request frame, unread."""

    request: bytes


class SandboxFailed(Message, tag="sandbox.failed"):
    """Sandbox -> sender: what it was asked failed; the connection ends."""

    error: str


SandboxReport = SandboxReady | SandboxWired | SandboxMapped | SandboxServed | SandboxAsk | SandboxFailed
SandboxOrder = SandboxServe | SandboxRelease | SandboxWire
