"""A pull's payloads as memfd regions a sandbox process maps (the sender's side; `child.py` maps).

A payload that is a stored tensor's own bytes in a placed memfd (`memfd.place`: one sealed memfd
per stored context) is granted where it lies: zero copy, and the sandbox maps that context only.
Any other payload (a codec's encoding, a slice that is not contiguous, a CUDA tensor) is copied
into one sealed memfd made for the pull, closed when the pull ends; its bytes replace the
encoded tensors, which the caller drops. `export` blocks for the copy; `export_async` runs it off the event loop when there is one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import msgspec
import torch

from droidmesh.shared.transport import codecs, memfd, workers
from droidmesh.shared.wire.sandbox import SandboxRegion
from droidmesh.shared.wire.schemas import PullRequest


@dataclasses.dataclass
class Exported:
    fds: list[int]  # to pass with the grant, in region order of first use
    regions: list[SandboxRegion]  # one per payload, in order
    scratch: list[int]  # the per-pull memfd (ours to close when the pull ends), if one was made

    def close(self) -> None:
        for fd in self.scratch:
            os.close(fd)
        self.scratch.clear()


async def export_async(payloads: Sequence[torch.Tensor]) -> Exported:
    """`export` on the event loop when every payload lies in a placed memfd (nothing to copy: a
    thread hop would cost more), else on a copying thread. Cancelled, it returns once the copy is
    made and closed (`workers.run_settled`): the pull's hold, released after this, charges it
    while it is made."""
    if all(memfd.placed(p) is not None or not p.numel() for p in payloads):
        return export(payloads)
    return await workers.run_settled(workers.copiers(), export, payloads, abandon=Exported.close)


def host_only(request: PullRequest) -> PullRequest:
    """`request` without an ask for device payloads: a sandbox maps host memfds only."""
    if not codecs.asks_device(request.codec_params):
        return request
    params = {k: v for k, v in request.codec_params.items() if k != codecs.DEVICE_PARAM}
    return msgspec.structs.replace(request, codec_params=params)


def export(payloads: Sequence[torch.Tensor]) -> Exported:
    """Every payload's region: where it lies in a placed memfd, else in a per-pull copy."""
    fds: list[int] = []
    regions: list[SandboxRegion] = []
    copies: list[tuple[int, torch.Tensor]] = []  # (offset in the per-pull memfd, payload)
    copy_bytes = 0
    for p in payloads:
        nbytes = p.numel() * p.element_size()
        found = memfd.placed(p) if nbytes else None
        if found is not None:
            seg, offset = found
            if seg.fd not in fds:
                fds.append(seg.fd)
            regions.append(SandboxRegion(fd=fds.index(seg.fd), offset=offset, nbytes=nbytes))
        else:  # fd -1 until the per-pull memfd exists
            regions.append(SandboxRegion(fd=-1, offset=copy_bytes, nbytes=nbytes))
            if nbytes:
                copies.append((copy_bytes, p))
                copy_bytes += -(-nbytes // memfd.ALIGN) * memfd.ALIGN
    scratch = []
    if copies:
        scratch.append(memfd.sealed_memfd(copy_bytes, copies))
        fds.append(scratch[0])
        for r in regions:
            if r.fd < 0 and r.nbytes:
                r.fd = len(fds) - 1
    for r in regions:
        if r.fd < 0:
            r.fd = 0  # an empty payload: no bytes to find
    return Exported(fds, regions, scratch)
