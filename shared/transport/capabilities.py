"""Whether the UCX channel may hand CUDA memory to UCX, decided once per process.

Sequence:
  1. `cuda_facts()` gathers what decides it: does torch see a CUDA device, and which UCX
     transports are active once ucxx is initialised with DroidMesh's options (`ucx.ucxx()`; an
     operator's `UCX_TLS` wins). It initialises ucxx, so it runs where the channel will run anyway;
  2. `decide(facts)` (pure, unit-tested) turns them into a `CudaSupport`:
       - no CUDA device, ucxx unavailable, or no `cuda_copy` among the active transports: UCX
         cannot take device memory; a pull of CUDA tensors stages through pinned host memory;
       - `cuda_copy` active: UCX takes device memory; with `cuda_ipc` too, a same-node pull between
         two processes is one device-to-device copy, without it UCX pipelines the bytes through
         its own host bounce buffers (still no staging copy of ours);
  3. `ucx_cuda_support()` caches the decision; `note_staging(side, support)` logs, once per side,
     that CUDA tensors are staged and why.
"""

from __future__ import annotations

import dataclasses
import functools

import structlog
import torch

log = structlog.get_logger("capabilities")


@dataclasses.dataclass(frozen=True)
class CudaFacts:
    torch_cuda: bool  # torch.cuda.is_available()
    transports: frozenset[str] | None  # UCX's active transports; None where ucxx did not initialise
    ucx_problem: str = ""  # why `transports` is None


@dataclasses.dataclass(frozen=True)
class CudaSupport:
    device_memory: bool  # UCX may be given CUDA buffers to send and receive
    ipc: bool  # and cuda_ipc is active: same-node pulls are device-to-device
    reason: str  # one line, for logs and the transfer check


def decide(facts: CudaFacts) -> CudaSupport:
    if not facts.torch_cuda:
        return CudaSupport(False, False, "torch sees no CUDA device (CPU build of torch, or no GPU)")
    if facts.transports is None:
        return CudaSupport(False, False, f"ucxx unavailable: {facts.ucx_problem}")
    active = ",".join(sorted(facts.transports)) or "none"
    if "cuda_copy" not in facts.transports:
        return CudaSupport(False, False, f"UCX has no cuda_copy transport (UCX built without CUDA, or UCX_TLS "
                                         f"leaves it out; active: {active})")
    if "cuda_ipc" not in facts.transports:
        return CudaSupport(True, False, f"cuda_copy without cuda_ipc: UCX moves device memory through its own "
                                        f"host bounce buffers (active: {active})")
    return CudaSupport(True, True, f"cuda_copy and cuda_ipc active: device-to-device (active: {active})")


def cuda_facts() -> CudaFacts:
    if not torch.cuda.is_available():  # UCX's transports do not matter then: skip initialising it
        return CudaFacts(False, None, "not checked")
    from droidmesh.shared.transport.ucx import ucxx

    try:
        return CudaFacts(True, frozenset(ucxx().get_active_transports()))
    except Exception as e:  # not installed, or built for another CUDA: the reason is the fact
        return CudaFacts(True, None, f"{type(e).__name__}: {e}")


@functools.cache
def ucx_cuda_support() -> CudaSupport:
    return decide(cuda_facts())


_NOTED: set[str] = set()


def note_staging(side: str, support: CudaSupport) -> None:
    """Log once per `side` ("sender", "receiver") that CUDA tensors travel through pinned host memory."""
    if side not in _NOTED:
        _NOTED.add(side)
        log.warning("ucx_cuda_staging", side=side, reason=support.reason,
                    effect="CUDA tensors are staged through pinned host memory")
