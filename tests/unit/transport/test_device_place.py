"""Where a CUDA sender places a context for export (`cuda_ipc`): one allocation, items ALIGN
apart, at least OWN_BLOCK in STEP steps; the bytes no item covers (zeroed before export, since an
IPC handle opens every byte); and the rule that only an allocation that is its whole device
allocation is exported (else the handle would reach other tensors' memory). The driver's answer
is a parameter, so the rule runs here; on a GPU, `place` itself is checked against the driver."""

from __future__ import annotations

import itertools

import pytest
import torch

from droidmesh.shared.transport import cuda_ipc
from droidmesh.shared.transport.cuda_ipc import ALIGN, OWN_BLOCK, STEP, alone, gaps, layout


def test_items_lie_align_apart_in_an_allocation_of_whole_steps():
    offsets, size = layout([1000, 512, 3])
    assert offsets == [0, 1024, 1536] and size == OWN_BLOCK
    offsets, size = layout([OWN_BLOCK, 1])
    assert offsets == [0, OWN_BLOCK] and size == OWN_BLOCK + STEP and size % STEP == 0
    assert all(o % ALIGN == 0 for o in offsets)


def test_the_gaps_are_every_byte_no_item_covers():
    nbytes = [1000, 512, 3]
    offsets, size = layout(nbytes)
    holes = gaps(offsets, nbytes, size)
    assert holes == [(1000, 1024), (1539, size)]
    covered = sorted([(o, o + n) for o, n in zip(offsets, nbytes, strict=True)] + holes)
    assert covered[0][0] == 0 and covered[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # back to back: nothing missed, nothing twice
    assert gaps([0], [STEP], STEP) == []


@pytest.mark.parametrize("seg,refused", [
    ((4096, OWN_BLOCK), False),  # the whole device allocation: exported
    ((0, 4 * OWN_BLOCK), True),  # inside a larger cached block: the handle would reach its neighbours
    ((4096, 2 * OWN_BLOCK), True),  # its start, with a tail the allocator may give to others
    (None, False),  # the driver cannot say: `_share_cuda_`'s offset decides
])
def test_only_a_whole_device_allocation_is_exported(seg, refused):
    why = alone(4096, OWN_BLOCK, seg)
    assert bool(why) == refused and (not why or "other tensors' memory" in why)


def test_without_a_driver_the_segment_is_unknown():
    if torch.cuda.is_available():
        pytest.skip("a driver is present")
    assert cuda_ipc.segment(4096) is None


@pytest.mark.gpu
def test_a_placed_context_is_its_whole_allocation_with_its_gaps_zeroed():
    device = torch.device("cuda", torch.cuda.current_device())
    dirty = torch.full((4 * OWN_BLOCK,), 7, dtype=torch.uint8, device=device)
    del dirty  # its block is cached: a new allocation may reuse its bytes
    tensors = [torch.randn(1, 2, 33, 8, device=device), torch.randn(1, 2, 33, 8, device=device)]
    views = cuda_ipc.place(tensors)
    assert all(torch.equal(v, t) for v, t in zip(views, tensors, strict=True))  # bitwise: copied bytes
    base = views[0].untyped_storage().data_ptr()
    exported = cuda_ipc.exported(views[0])
    if exported is None:  # the allocator served it from inside a cached block: not exported, and said so
        pytest.skip("this allocation was refused for export (device_export_skipped)")
    seg = cuda_ipc.segment(base)
    assert seg is not None and seg == (base, exported[0].nbytes)
    slab = torch.empty(0, dtype=torch.uint8, device=device).set_(views[0].untyped_storage())  # [size]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    offsets, size = layout(nbytes)
    assert all(int(slab[a:b].count_nonzero()) == 0 for a, b in gaps(offsets, nbytes, size))
