"""The sender's byte-bounded LRU store of captured contexts.

Invariant: `nbytes <= budget` after every `put` (a context larger than the budget is refused).
Touched by the event loop only, so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.blocks import CapturedContext


class CacheStore:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._items: OrderedDict[str, CapturedContext] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def put(self, context_id: str, captured: CapturedContext) -> list[str]:
        """Store `captured` as most recent; return the ids evicted to stay within budget."""
        size = captured.nbytes
        if size > self.budget:
            raise BadRequestError(f"context of {size} bytes exceeds the store budget of {self.budget}")
        if context_id in self._items:
            self.nbytes -= self._items.pop(context_id).nbytes
        evicted = []
        while self.nbytes + size > self.budget:
            old_id, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
            evicted.append(old_id)
        self._items[context_id] = captured
        self.nbytes += size
        self.evictions += len(evicted)
        return evicted

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
