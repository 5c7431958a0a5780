"""A context held on a GPU, exported once for same-host receivers (CUDA IPC), and read by offset.

`place` (the sender's torch thread, once per stored context) copies a CUDA context into one
device allocation of its own and exports it: torch's CUDA IPC export of the allocation's storage
(`UntypedStorage._share_cuda_`, what `torch.multiprocessing` sends for a CUDA tensor), registered
in `REGISTRY` (`exports.ExportRegistry`) until the context's tensors die. A receiver opens the
handle once per export (`open_export`, through `exports.Mappings`) and copies each granted item's
rows out of the mapping on the device (`read`): no host staging, no per-pull handle, no checksum
(a same-host mapping has no wire to corrupt bytes; a hostile sender's bytes are still screened).

An IPC handle opens the whole block the caching allocator carved the storage from, so the
allocation is made large enough to be a block of its own when the allocator makes a new one (at
least `OWN_BLOCK` bytes, in 2 MiB steps) and is exported only when its storage starts that block
(offset 0): a handle never reaches another tensor's memory. A cached free block can still serve
the request from inside a larger one (the allocator splits what it has cached); such a context
is not exported, and says so (`device_export_skipped`, with the offset): its pulls are copied
through a host memfd, which is slower but correct. A receiver's open mapping keeps the allocation alive after the sender
drops it (torch's IPC reference count), so receivers close mappings as soon as a grant reports
the export released.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import msgspec
import structlog
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport.exports import Export, ExportRegistry, Mapping

log = structlog.get_logger("cuda_ipc")
REGISTRY = ExportRegistry()
ALIGN = 512  # bytes between items of one allocation
STEP = 2 << 20
OWN_BLOCK = 10 << 20  # torch's caching allocator gives a request this large a block of its own
_SHARED = tuple[int, bytes, int, int, bytes, int, bytes, bool]  # `_share_cuda_`'s answer, as the wire carries it


class _Owner:
    """Referenced by every view `place` returns: when the last dies, the export is released."""


def place(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` (one stored context's, all on one CUDA device) copied into one exported device
    allocation and returned as views of it; anything else is returned as it is (pulls of those
    go through per-pull copies), as is a context whose allocation could not be exported alone."""
    if not tensors or any(t.device.type != "cuda" for t in tensors) or len({t.device for t in tensors}) != 1:
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    size = max(OWN_BLOCK, -(-total // STEP) * STEP)
    slab = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)  # [size]
    views = [slab[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors, strict=True)]
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    torch.cuda.synchronize(slab.device)  # the bytes are there before any receiver can open the handle
    shared = slab.untyped_storage()._share_cuda_()
    if shared[3] != 0:  # the storage does not start its block: the handle would reach its neighbours
        log.warning("device_export_skipped", offset=shared[3], nbytes=size,
                    why="the allocator served the context from inside a cached block; pulls of it are copied")
        return list(tensors)
    export = REGISTRY.add(slab.data_ptr(), size, msgspec.msgpack.encode(list(shared)))
    owner = _Owner()
    weakref.finalize(owner, REGISTRY.release, slab.data_ptr(), export.export_id)
    for view in views:
        view._droidmesh_export = owner  # type: ignore[attr-defined]  # the views keep the export alive
    return views


def exported(t: torch.Tensor) -> tuple[Export, int] | None:
    """(its export, its byte offset there) when `t` is a contiguous view of a placed allocation."""
    if t.device.type != "cuda" or not t.is_contiguous():
        return None
    base = t.untyped_storage().data_ptr()
    offset = t.data_ptr() - base
    export = REGISTRY.locate(base, offset, t.numel() * t.element_size())
    return None if export is None else (export, offset)


class CudaExporter:
    """The shm server's device side (`exports.Exporter`): this module's functions and registry."""

    registry = REGISTRY
    place = staticmethod(place)
    exported = staticmethod(exported)


@dataclasses.dataclass
class DeviceMapping:
    """An opened export: `tensor` is uint8 [nbytes] over the sender's allocation."""

    tensor: torch.Tensor | None
    nbytes: int

    def close(self) -> None:
        self.tensor = None  # the last reference: torch closes the IPC mapping and its reference count


def open_export(export: Export) -> DeviceMapping:
    """Open `export`'s handle (a receiver, once per export). A handle that does not decode as
    `_share_cuda_`'s answer, or that the driver refuses, is an `IntegrityError`."""
    try:
        args = msgspec.msgpack.decode(export.handle, type=_SHARED)
        storage = torch.UntypedStorage._new_shared_cuda(*args)
    except (msgspec.DecodeError, RuntimeError, TypeError) as e:
        raise IntegrityError(f"export {export.export_id}: cannot open its handle ({type(e).__name__})") from None
    tensor = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # [nbytes]
    return DeviceMapping(tensor, storage.nbytes())


def read(mapping: Mapping, offset: int, stride: int, rows: int, row: int, into: torch.Tensor) -> None:
    """Copy `rows` rows of `row` bytes at `offset + r * stride` of the mapping into `into` (uint8,
    rows x row bytes, on the mapping's device), on the current stream. The region was checked
    (`exports.check_region`) before this is called."""
    if mapping.tensor is None:
        raise IntegrityError("read from a closed mapping")
    if rows and row:
        src = mapping.tensor.as_strided((rows, row), (stride, 1), offset)  # [rows, row] of the sender's bytes
        into.view(rows, row).copy_(src, non_blocking=True)
