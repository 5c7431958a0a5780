"""`memfd.place`: a stored context moved into one sealed memfd, read-only, freed with its tensors."""

from __future__ import annotations

import fcntl
import gc
import os

import torch

from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import random_model
from droidmesh.shared.transport import memfd
from tests.conftest import FAMILIES


def _open_fds() -> int:
    """This process's open KV memfds (only those: UCX and NIXL threads of earlier tests may still
    be closing their own sockets while this test counts)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:droidmesh-kv")
        except OSError:  # closed meanwhile
            pass
    return count


def test_placed_tensors_equal_the_originals_in_one_sealed_memfd():
    """Every tensor comes back equal, viewing one mapping whose memfd is sealed against write, shrink and grow."""
    tensors = [torch.randn(1, 2, 7, 8, dtype=torch.bfloat16), torch.randn(1, 2, 7, 8, dtype=torch.bfloat16),
               torch.randn(1, 7, 5, dtype=torch.bfloat16)]  # odd sizes: each is aligned in the memfd
    placed = memfd.place(tensors)
    assert all(torch.equal(p, t) and p.dtype == t.dtype for p, t in zip(placed, tensors, strict=True))  # bitwise: placing copies the bytes
    segments = {memfd.placed(p)[0] for p in placed}  # type: ignore[index]
    assert len(segments) == 1
    seals = fcntl.fcntl(segments.pop().fd, fcntl.F_GET_SEALS)
    assert seals & memfd.SEALS == memfd.SEALS


def test_the_memfd_closes_when_the_last_view_dies():
    """The mapping and its memfd live exactly as long as some placed tensor (or a view of one) does."""
    gc.collect()  # placements of earlier tests that only a cycle still holds
    before = _open_fds()
    placed = memfd.place([torch.randn(64, 64) for _ in range(3)])
    keep = placed[1][:2]
    held = _open_fds() - before  # the memfd, and the mapping's own duplicate of it
    assert held >= 1
    del placed
    gc.collect()
    assert _open_fds() == before + held  # `keep` still views the mapping
    del keep
    gc.collect()
    assert _open_fds() == before and not any(seg for seg in memfd._SEGMENTS.values() if seg.nbytes == 3 * 64 * 64 * 4)


def test_empty_contexts_are_left_as_they_are():
    """Nothing to share: no memfd, the same tensors back."""
    empty = [torch.empty(1, 2, 0, 8)]
    assert memfd.place(empty)[0] is empty[0] and memfd.place([]) == []


def test_items_and_with_items_round_trip_every_tensor():
    """items() lists K, V (and E) per layer, loose E last; with_items puts replacements back in place."""
    fp = random_model("llama", **FAMILIES["llama"]).fingerprint
    kv = tuple(KVBlock(l, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)) for l in range(2))
    ctx = CapturedContext((1, 2, 3), fp, "m", kv, {1: torch.randn(1, 3, 16), 5: torch.randn(1, 3, 16)})
    items = ctx.items()
    assert all(t is u for t, u in zip(items, [kv[0].k, kv[0].v, kv[1].k, kv[1].v, ctx.e[1], ctx.e[5]], strict=True))
    back = ctx.with_items([t + 1 for t in items])
    # bitwise: the same +1 on the same values
    assert torch.equal(back.kv[1].v, kv[1].v + 1) and torch.equal(back.e[5], ctx.e[5] + 1) and set(back.e) == {1, 5}


def test_a_placed_context_serves_the_senders_own_generation():
    """Generation over a placed (read-only) context gives exactly the tokens of the unplaced one."""
    torch.manual_seed(0)
    model = random_model("llama", **FAMILIES["llama"])
    ids = torch.randint(0, 97, (24,)).tolist()
    captured = capture_prefill(model, ids[:20], [1])
    placed = captured.with_items(memfd.place(captured.items()))
    want = generate(model, ids, ReusePlan.full_reuse(), CapturedSource(captured), max_new_tokens=4)
    got = generate(model, ids, ReusePlan.full_reuse(), CapturedSource(placed), max_new_tokens=4)
    assert got.tokens == want.tokens
    assert all(torch.equal(a, b) for a, b in zip(placed.items(), captured.items(), strict=True))  # bitwise: placing copies the bytes
