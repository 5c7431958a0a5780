"""A context held on a GPU, exported once for same-host receivers (CUDA IPC), and read by offset.

`place` (the sender's torch thread, once per stored context) copies a CUDA context into one
device allocation of its own and exports it: torch's CUDA IPC export of the allocation's storage
(`UntypedStorage._share_cuda_`, what `torch.multiprocessing` sends for a CUDA tensor), registered
in `REGISTRY` (`exports.ExportRegistry`) until the context's tensors die. A receiver opens the
handle once per export (`open_export`, through `exports.Mappings`) and copies each granted item's
rows out of the mapping on the device (`read`): no host staging, no per-pull handle, no checksum
(a same-host mapping has no wire to corrupt bytes; a hostile sender's bytes are still screened).

An IPC handle opens the whole device allocation holding the storage, so a context's allocation
comes from a memory pool of exports alone (no other tensor's freed block, a prefill's
activations say, can serve it), is large enough to be a device allocation of its own when the
allocator makes a new one (at least `OWN_BLOCK` bytes, in 2 MiB steps), and is exported only
when it is that whole device allocation (the driver's `cuMemGetAddressRange`; where the driver
cannot be asked, when its storage starts its block): a handle never reaches another tensor's
memory. Its bytes no item covers are zeroed, so it shows nothing left from memory used before.
The pool can still serve it from inside a larger freed export; such a context is not exported,
and says so (`device_export_skipped`, with the reason): its pulls are copied through a host
memfd, slower but correct. A receiver's open mapping keeps the allocation alive after the sender
drops it (torch's IPC reference count), so receivers close mappings as soon as a grant reports
the export released.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport.exports import Export, ExportRegistry, Mapping

log = structlog.get_logger("cuda_ipc")
REGISTRY = ExportRegistry()
_NO_POOL: set[int] = set()  # devices where torch could not allocate from a pool
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
    nbytes = [t.numel() * t.element_size() for t in tensors]
    offsets, size = layout(nbytes)
    slab = _allocate(size, tensors[0].device)  # [size]
    why = alone(slab.data_ptr(), size, segment(slab.data_ptr()))
    if why:
        log.warning("device_export_skipped", nbytes=size, why=why)
        return list(tensors)
    views = [slab[o:o + n].view(t.dtype).view(t.shape) for o, n, t in zip(offsets, nbytes, tensors, strict=True)]
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    for start, end in gaps(offsets, nbytes, size):
        slab[start:end].zero_()  # the handle opens every byte: none is left from memory used before
    torch.cuda.synchronize(slab.device)  # the bytes are there before any receiver can open the handle
    try:
        shared = slab.untyped_storage()._share_cuda_()
    except RuntimeError as e:  # this build or allocation cannot be shared: served by copies, said once per context
        log.warning("device_export_skipped", nbytes=size, why=f"cannot share it: {e}"[:300])
        return list(tensors)
    if shared[3] != 0:  # the storage does not start its block (checked above where the driver says)
        log.warning("device_export_skipped", nbytes=size, why=f"the storage starts {shared[3]} bytes into its block")
        return list(tensors)
    export = REGISTRY.add(slab.data_ptr(), size, msgspec.msgpack.encode(list(shared)))
    owner = _Owner()
    weakref.finalize(owner, REGISTRY.release, slab.data_ptr(), export.export_id)
    for view in views:
        view._droidmesh_export = owner  # type: ignore[attr-defined]  # the views keep the export alive
    return views


def _allocate(size: int, device: torch.device) -> torch.Tensor:
    """uint8 [size] on `device`, from this process's pool of exported allocations where torch has
    memory pools: there no other tensor's freed block (a prefill's activations, say) can serve it
    from inside a larger one, so a new allocation is a device allocation of its own."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = None if index in _NO_POOL else _pool(index)
    if pool is not None:
        try:
            with torch.cuda.use_mem_pool(pool, device=device):
                return torch.empty(size, dtype=torch.uint8, device=device)
        except (AttributeError, TypeError) as e:  # a torch without `use_mem_pool` (or this signature)
            log.warning("export_pool_unavailable", device=index, error=f"{type(e).__name__}: {e}")
            _NO_POOL.add(index)
    return torch.empty(size, dtype=torch.uint8, device=device)


@functools.cache
def _pool(index: int) -> Any:
    """The pool of exported allocations on device `index` (kept for the process), or None."""
    try:
        return torch.cuda.MemPool()
    except (AttributeError, RuntimeError, TypeError) as e:
        log.warning("export_pool_unavailable", device=index, error=f"{type(e).__name__}: {e}")
        return None


def layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Each item's offset in one allocation (ALIGN apart) and the allocation's size (at least
    OWN_BLOCK, in STEP steps: a new block of its own from the caching allocator)."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, max(OWN_BLOCK, -(-total // STEP) * STEP)


def gaps(offsets: list[int], nbytes: list[int], size: int) -> list[tuple[int, int]]:
    """The byte ranges of an allocation of `size` that no item covers (alignment and the tail)."""
    out, at = [], 0
    for o, n in zip(offsets, nbytes, strict=True):
        if o > at:
            out.append((at, o))
        at = max(at, o + n)
    return out + [(at, size)] if at < size else out


def alone(ptr: int, size: int, seg: tuple[int, int] | None) -> str:
    """Why an allocation of `size` at `ptr` must not be exported ("" when it may): an IPC handle
    opens the whole device allocation holding it (`seg`: its base and size, from the driver), so
    it must be that allocation exactly, or the handle would reach other tensors' memory."""
    if seg is None:
        return ""  # the driver cannot say: `_share_cuda_`'s offset is checked instead
    base, seg_size = seg
    if (base, seg_size) != (ptr, size):
        return (f"the allocator served it from a cached block of {seg_size} bytes at offset {ptr - base}: "
                "a handle would reach other tensors' memory; pulls of it are copied")
    return ""


def segment(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation holding `ptr` (`cuMemGetAddressRange`: the block of
    the caching allocator an IPC handle opens), or None where the driver cannot be asked."""
    fn = _address_range()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return base.value, size.value


@functools.cache
def _address_range() -> Any:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


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
