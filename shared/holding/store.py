"""The sender's byte-bounded LRU store of captured contexts, and the holds pulls take on it.

Invariants (touched by the event loop only, so no lock):
  - `nbytes + orphaned_bytes <= budget` after every `put`: a context a pull holds is never
    evicted for room (that would free nothing), and one replaced or evicted while held is gone
    from the index but not from memory, so its bytes keep counting (`orphaned_bytes`) until the
    last hold on it is released; a put that cannot fit beside them is refused, never exceeding
    the budget;
  - `pull_bytes <= pull_budget`: copies made for pulls (a K / V slice, CUDA staging) are charged
    by the pull before they exist and refunded when it releases; a charge past the budget
    refuses that pull (the receiver falls back), never grows memory.
Channels release a hold when the pull's sends complete, fail or time out, so a pull that never
drains holds memory only until its send deadline.

Tiers: with a `device_budget`, contexts held in device memory (a GPU sender's) take at most that
many bytes of it; past it the least recently used ones move to host memory (`device_victims`
names them, the holder copies them off the device on its torch thread, `move` swaps each in
place, keeping its recency) before anything is evicted, so a GPU sender keeps serving them, from
host memory, until the whole store's budget runs out. A context a pull holds is not moved.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from droidmesh.shared.errors import BadRequestError, TransferError
from droidmesh.shared.kv.blocks import CapturedContext


class CacheStore:
    def __init__(self, budget_bytes: int, pull_budget_bytes: int | None = None, device_budget_bytes: int = 0):
        self.budget = budget_bytes
        self.pull_budget = budget_bytes if pull_budget_bytes is None else pull_budget_bytes
        self.device_budget = device_budget_bytes  # 0: device-held contexts are bounded by `budget` alone
        self.moves = 0  # contexts moved from device to host memory
        self._items: OrderedDict[str, CapturedContext] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0
        self.orphaned_bytes = 0  # evicted contexts still pinned by pulls
        self.pull_bytes = 0  # per-pull copies in flight
        self._pins: dict[int, list] = {}  # id(captured) -> [captured, holds, orphaned?]

    @property
    def resident_bytes(self) -> int:
        """What the store and its pulls keep in memory."""
        return self.nbytes + self.orphaned_bytes + self.pull_bytes

    def put(self, context_id: str, captured: CapturedContext) -> list[str]:
        """Store `captured` as most recent; return the ids evicted to stay within budget."""
        size = captured.nbytes
        if size > self.budget:
            raise BadRequestError(f"context of {size} bytes exceeds the store budget of {self.budget}")
        # Evicting a context a pull pins frees nothing, so those (and earlier evictions still
        # pinned) must leave room on their own; only unpinned contexts are evicted, LRU first.
        pinned = sum(c.nbytes for c in self._items.values() if id(c) in self._pins)
        if self.orphaned_bytes + pinned + size > self.budget:
            raise BadRequestError(f"store budget of {self.budget} bytes is held by pulls still in flight "
                                  f"({self.orphaned_bytes + pinned} bytes); try again")
        replaced = self._items.pop(context_id, None)
        if replaced is not None:
            self._drop(replaced)
        evicted = []
        for old_id, old in list(self._items.items()):
            if self.nbytes + self.orphaned_bytes + size <= self.budget:
                break
            if id(old) not in self._pins:
                self._drop(self._items.pop(old_id))
                evicted.append(old_id)
        self._items[context_id] = captured
        self.nbytes += size
        self.evictions += len(evicted)
        return evicted

    @property
    def device_bytes(self) -> int:
        """Bytes of the stored contexts held in device memory."""
        return sum(c.nbytes for c in self._items.values() if on_device(c))

    def device_victims(self, incoming: int) -> list[tuple[str, CapturedContext]]:
        """The device contexts to move to host memory, least recently used first, so that
        `incoming` more device bytes fit the device budget (none without one); contexts pulls
        hold stay where they are."""
        if not self.device_budget:
            return []
        over = self.device_bytes + incoming - self.device_budget
        out = []
        for cid, c in self._items.items():
            if over <= 0:
                break
            if on_device(c) and id(c) not in self._pins:
                out.append((cid, c))
                over -= c.nbytes
        return out

    def move(self, context_id: str, old: CapturedContext, new: CapturedContext) -> bool:
        """Swap `old` (still stored under `context_id`, not held by a pull) for `new`, the same
        context in other memory, keeping its place in the recency order; False if it changed meanwhile."""
        if self._items.get(context_id) is not old or id(old) in self._pins or new.nbytes != old.nbytes:
            return False
        self._items[context_id] = new  # an existing key keeps its position in the OrderedDict
        self.moves += 1
        return True

    def _drop(self, old: CapturedContext) -> None:
        self.nbytes -= old.nbytes
        pin = self._pins.get(id(old))
        if pin is not None and not pin[2]:
            pin[2] = True
            self.orphaned_bytes += old.nbytes

    def hold(self, context_id: str) -> PullHold:
        """A hold for one pull of `context_id` (pins it if stored); `release` it when the pull ends."""
        captured = self._items.get(context_id)
        if captured is not None:
            pin = self._pins.setdefault(id(captured), [captured, 0, False])
            pin[1] += 1
        return PullHold(self, captured)

    def _unpin(self, captured: CapturedContext) -> None:
        pin = self._pins[id(captured)]
        pin[1] -= 1
        if pin[1] == 0:
            del self._pins[id(captured)]
            if pin[2]:
                self.orphaned_bytes -= captured.nbytes

    def get(self, context_id: str) -> CapturedContext | None:
        item = self._items.get(context_id)
        if item is not None:
            self._items.move_to_end(context_id)
        return item

    def tensor(self, context_id: str, layer: int, kind: str) -> torch.Tensor | None:
        """The stored K, V or E tensor, or None (unknown context, layer or kind)."""
        item = self.get(context_id)
        if item is None:
            return None
        if kind == "E":
            return item.e.get(layer)
        if not 0 <= layer < item.num_layers or kind not in ("K", "V"):
            return None
        block = item.kv[layer]
        return block.k if kind == "K" else block.v

    def ids(self) -> list[str]:
        return list(self._items)

    def items(self) -> list[tuple[str, CapturedContext]]:
        return list(self._items.items())


class PullHold:
    """One pull's hold (`bulk.PullHold`): pins the context it pulls and counts its copies."""

    def __init__(self, store: CacheStore, captured: CapturedContext | None):
        self._store, self._captured = store, captured
        self._charged = 0
        self._released = False

    def charge(self, nbytes: int) -> None:
        store = self._store
        if self._released:
            raise TransferError("pull already released")
        if store.pull_bytes + nbytes > store.pull_budget:
            raise TransferError(f"sender busy: {store.pull_bytes} bytes of pull copies in flight, "
                                f"{nbytes} more would pass the pull budget of {store.pull_budget}")
        store.pull_bytes += nbytes
        self._charged += nbytes

    def refund(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._charged)
        self._charged -= nbytes
        self._store.pull_bytes -= nbytes

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.refund(self._charged)
        if self._captured is not None:
            self._store._unpin(self._captured)


def on_device(captured: CapturedContext) -> bool:
    """Whether a context's tensors live in device memory (anything but the host's)."""
    items = captured.items()
    return bool(items) and items[0].device.type != "cpu"
