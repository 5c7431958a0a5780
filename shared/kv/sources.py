"""Layer sources: where the engine gets the sender's per-layer KV and E from.

`LayerSource` is the engine's narrow interface to the data plane (called from the engine's
worker thread; both calls block until the layer is present or the deadline passes):
  - `kv(layer, deadline)`  the sender's KVBlock of `layer`
  - `e(layer, deadline)`   the sender's E tensor entering `layer`
plus the cached context's `token_ids` and `fingerprint`.

`CapturedSource` has everything up front. `ArrivingSource` is filled later, in any order, by a
transport (`put_kv` / `put_e` from any thread) and lets the engine start recomputing as soon as
E lands while the reused KV layers are still arriving: a wait is per layer, never global. Its
reads mark each tensor used on the engine's stream (`streams.adopt`: on CUDA, layers land on a
copy stream).

The engine is written as steps (generators) that yield a `Need` just before each source read.
`run_steps` drives them on the calling thread, leaving every wait to the source's blocking
calls (offline tools, tests). A service instead drives them so that the compute thread never
waits on the network: it runs each step on its torch thread and waits for the `Need` elsewhere
(`ArrivingSource.has` / `watch`), so another request's compute runs meanwhile.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import torch

from droidmesh.shared.errors import MissingLayerError
from droidmesh.shared.kv import streams
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.model.fingerprint import ArchFingerprint

if TYPE_CHECKING:
    from droidmesh.shared.kv.decode import Decoding

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Need:
    """The engine is about to read `kind` of `layer` from its source; a driver may wait for it
    first, until `deadline` (time.monotonic()). Past the deadline the read itself raises.
    Kind "turn" reads nothing: a point where a cooperative run (`turns=True`) lets its driver
    hand the compute thread to other work before going on (`layer` -1: a decode step).
    Kind "decode" carries the request's `decodings` (one per sample) once their first tokens are
    chosen: a driver that batches decodes them to their end with other requests before resuming
    the steps; one that does not resumes at once, and the steps decode them (together) alone."""

    kind: Literal["kv", "e", "turn", "decode"]
    layer: int
    deadline: float
    decodings: tuple[Decoding, ...] = ()


Steps = Generator[Need, None, T]


def run_steps(steps: Steps[T]) -> T:
    """Drive `steps` to the end on this thread; each read then waits in the source itself."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def run_until(steps: Steps[T], ready: Callable[[Need], bool]) -> tuple[bool, object]:
    """Run `steps` (under `torch.inference_mode`, on the calling thread: a driver's torch thread)
    past every `Need` that is `ready`; stop at the first that is not, (False, that Need), or at the
    end, (True, the steps' result). A Future cannot carry StopIteration, hence the tuple."""
    with torch.inference_mode():
        try:
            need = next(steps)
            while ready(need):
                need = next(steps)
            return False, need
        except StopIteration as done:
            return True, done.value


class LayerSource(Protocol):
    token_ids: tuple[int, ...]
    fingerprint: ArchFingerprint

    def kv(self, layer: int, deadline: float) -> KVBlock: ...

    def e(self, layer: int, deadline: float) -> torch.Tensor: ...


class CapturedSource:
    """A source over a `CapturedContext` already in memory (same process as the sender)."""

    def __init__(self, captured: CapturedContext):
        self.captured = captured
        self.token_ids = captured.token_ids
        self.fingerprint = captured.fingerprint

    def kv(self, layer: int, deadline: float) -> KVBlock:
        if not 0 <= layer < self.captured.num_layers:
            raise MissingLayerError(f"sender has no KV for layer {layer}")
        return self.captured.kv[layer]

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        if layer not in self.captured.e:
            raise MissingLayerError(f"sender captured no E for layer {layer} (has {sorted(self.captured.e)})")
        return self.captured.e[layer]


class ArrivingSource:
    """A source whose layers are delivered later by another thread, in any order."""

    def __init__(self, token_ids: tuple[int, ...], fingerprint: ArchFingerprint):
        self.token_ids = tuple(token_ids)
        self.fingerprint = fingerprint
        self._cond = threading.Condition()
        self._kv: dict[int, KVBlock] = {}
        self._e: dict[int, torch.Tensor] = {}
        self._failure: BaseException | None = None
        self._halves: dict[int, tuple[str, torch.Tensor]] = {}  # layer -> the half that came first
        self._watchers: list[Callable[[], None]] = []
        # Arrival stamps (time.perf_counter()) so callers can show what overlapped what.
        self.arrived_at: dict[str, float] = {}

    # -- producer side (transport thread) ------------------------------------------------
    def put_kv(self, block: KVBlock) -> None:
        with self._cond:
            self._kv[block.layer] = block
            self.arrived_at[f"kv{block.layer}"] = time.perf_counter()
            self._cond.notify_all()
        self._notify()

    def put_e(self, layer: int, e: torch.Tensor) -> None:
        with self._cond:
            self._e[layer] = e
            self.arrived_at[f"e{layer}"] = time.perf_counter()
            self._cond.notify_all()
        self._notify()

    def put(self, kind: str, layer: int, t: torch.Tensor) -> None:
        """Deliver one transferred tensor: "E", or one half ("K" / "V") of a layer's KV (the
        layer becomes available once both halves are in)."""
        if kind == "E":
            self.put_e(layer, t)
            return
        with self._cond:
            half = self._halves.pop(layer, None)
            if half is None:
                self._halves[layer] = (kind, t)
                return
        k, v = (half[1], t) if half[0] == "K" else (t, half[1])
        self.put_kv(KVBlock(layer, k, v))

    def fail(self, exc: BaseException) -> None:
        """Abort every current and future wait with `exc` (e.g. the sender died mid-transfer)."""
        with self._cond:
            self._failure = exc
            self._cond.notify_all()
        self._notify()

    # -- for drivers that wait outside the engine -----------------------------------------
    def watch(self, fn: Callable[[], None]) -> None:
        """Call `fn` (from the producer's thread; it must not block) after every delivery and
        on failure."""
        self._watchers.append(fn)

    def has(self, need: Need) -> bool:
        """Whether the engine's read for `need` would return (or fail) without waiting."""
        if need.kind in ("turn", "decode"):
            return True
        with self._cond:
            table: dict = self._kv if need.kind == "kv" else self._e
            return need.layer in table or self._failure is not None

    def _notify(self) -> None:
        for fn in self._watchers:
            fn()

    # -- consumer side (engine thread) ---------------------------------------------------
    def kv(self, layer: int, deadline: float) -> KVBlock:
        block: KVBlock = self._wait(self._kv, layer, deadline, "KV")
        streams.adopt(block.k)
        streams.adopt(block.v)
        return block

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        return streams.adopt(self._wait(self._e, layer, deadline, "E"))

    def _wait(self, table: dict, layer: int, deadline: float, kind: str):
        with self._cond:
            while layer not in table:
                if self._failure is not None:
                    raise MissingLayerError(f"{kind} of layer {layer} will not arrive: {self._failure}") from self._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingLayerError(f"{kind} of layer {layer} did not arrive before the deadline")
                self._cond.wait(left)
            return table[layer]
