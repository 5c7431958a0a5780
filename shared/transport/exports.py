"""Device memory exported once and mapped once: the sender's registry of exported allocations, the
receiver's mappings of them, and the bounds every read by offset is checked against.

A sender that holds a context on a GPU keeps it in one device allocation (`cuda_ipc.place`),
exported when it is made: the export's handle (CUDA IPC) is what a receiver on the same host
opens to read it. Opening a handle costs a driver call and a mapping, so a pull must not pay it:

* the sender's `ExportRegistry` numbers each export and forgets it when the context's tensors
  die (evicted, replaced); the grant of a pull names each export it reads (number, size, handle)
  and every export of this connection released since its last grant;
* the receiver's `Mappings` (one per connection) opens an export the first time a grant names it
  and reads it by offset from then on; it closes a mapping when a grant says it was released,
  when the sender's incarnation changes (a restarted sender numbers from 1 again: an old
  mapping must never be taken for a new export of the same number), when the connection has
  been idle for a while (the shm client's timer) and when the connection goes;
* every region is checked against the export's size before a byte is read (`check_region`), and
  an export's declared size against the opened allocation's own.

This module is torch-free and device-free: the opener is a parameter (CUDA IPC in `cuda_ipc`,
an in-process stand-in in tests), so the lifetime rules run and are tested on any machine.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from droidmesh.shared.errors import IntegrityError

MAX_MAPPINGS = 4096  # per connection: a sender holding more contexts than this is refused, not mapped


@dataclasses.dataclass(frozen=True)
class Export:
    export_id: int
    nbytes: int
    handle: bytes


class ExportRegistry:
    """The sender's exports, by number and by the address of the allocation they export."""

    def __init__(self) -> None:
        self.incarnation = secrets.token_hex(8)  # new per process: a restarted sender is another one
        self._lock = threading.Lock()  # added on the torch thread, released by finalizers, read on the loop
        self._next = 1
        self._live: dict[int, Export] = {}
        self._by_base: dict[int, int] = {}

    def add(self, base: int, nbytes: int, handle: bytes) -> Export:
        """Register the allocation at `base` (`nbytes`), exported as `handle`."""
        with self._lock:
            export = Export(self._next, nbytes, handle)
            self._next += 1
            self._live[export.export_id] = export
            self._by_base[base] = export.export_id
            return export

    def release(self, base: int, export_id: int) -> None:
        """The allocation's last user is gone: no grant names the export again."""
        with self._lock:
            self._live.pop(export_id, None)
            if self._by_base.get(base) == export_id:
                del self._by_base[base]

    def locate(self, base: int, offset: int, nbytes: int) -> Export | None:
        """The export of the allocation at `base` when [offset, offset + nbytes) lies in it."""
        with self._lock:
            export = self._live.get(self._by_base.get(base, 0))
        if export is None or offset < 0 or offset + nbytes > export.nbytes:
            return None
        return export

    def live(self, export_id: int) -> bool:
        with self._lock:
            return export_id in self._live

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


class Exporter(Protocol):
    """What places a sender's device contexts and finds where a stored tensor lies (`cuda_ipc`;
    tests use an in-process stand-in over host memory)."""

    registry: ExportRegistry

    def place(self, tensors: Sequence[Any]) -> list[Any]: ...

    def exported(self, t: Any) -> tuple[Export, int] | None: ...


class Sent:
    """One connection's record on the sender: which allocations its grants have named (device
    exports by number, placed memfds by inode), so a later grant can tell the receiver which of
    them were released since. `live` says whether one still holds its context."""

    def __init__(self, live: Callable[[int], bool]) -> None:
        self._live = live
        self._named: set[int] = set()

    def name(self, key: int) -> None:
        self._named.add(key)

    def released(self) -> list[int]:
        """Allocations named on this connection and released since (each reported once)."""
        gone = sorted(e for e in self._named if not self._live(e))
        self._named.difference_update(gone)
        return gone


class Mapping(Protocol):
    """An opened export: `tensor` views its bytes (uint8 [nbytes], on the sender's device), None
    once closed."""

    tensor: Any
    nbytes: int

    def close(self) -> None: ...


Opener = Callable[[Export], Mapping]


class Mappings:
    """One connection's open mappings of a sender's exports (the receiver's side)."""

    def __init__(self, opener: Opener, limit: int = MAX_MAPPINGS) -> None:
        self._open, self._limit = opener, limit
        self._incarnation: str | None = None
        self._maps: dict[int, tuple[Export, Mapping]] = {}
        self.opened = 0  # how many times a handle was opened: once per export, whatever the pulls

    def update(self, incarnation: str, exports: list[Export], released: list[int]) -> None:
        """A grant's news, before any of its regions is read: another incarnation drops every
        mapping; released exports are closed; an export named again must be the same export."""
        if incarnation != self._incarnation:
            self.close()
            self._incarnation = incarnation
        for export_id in released:
            self._drop(export_id)
        for export in exports:
            held = self._maps.get(export.export_id)
            if held is not None and held[0] != export:
                raise IntegrityError(f"export {export.export_id} named again with another size or handle")

    def get(self, export: Export) -> Mapping:
        """The open mapping of `export`, opened now if this is the first grant that reads it."""
        held = self._maps.get(export.export_id)
        if held is not None:
            return held[1]
        if len(self._maps) >= self._limit:
            raise IntegrityError(f"more than {self._limit} exports mapped from one sender")
        mapping = self._open(export)
        if mapping.nbytes < export.nbytes:
            mapping.close()
            raise IntegrityError(f"export {export.export_id} declares {export.nbytes} bytes; "
                                 f"its allocation holds {mapping.nbytes}")
        self.opened += 1
        self._maps[export.export_id] = (export, mapping)
        return mapping

    def _drop(self, export_id: int) -> None:
        held = self._maps.pop(export_id, None)
        if held is not None:
            held[1].close()

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for export_id in list(self._maps):
            self._drop(export_id)


def check_region(export: Export, offset: int, stride: int, rows: int, row: int) -> None:
    """`rows` rows of `row` bytes at `offset + r * stride` lie within `export` (rows and their
    length come from the receiver's own buffer, the offset and stride from the sender)."""
    if offset < 0 or row < 0 or rows < 0 or (rows > 1 and stride < row):
        raise IntegrityError(f"export {export.export_id}: bad region (offset {offset}, stride {stride})")
    if rows and row and offset + (rows - 1) * stride + row > export.nbytes:
        raise IntegrityError(f"export {export.export_id}: region (offset {offset}, stride {stride}, {rows} x {row}) "
                             f"ends past its {export.nbytes} bytes")
