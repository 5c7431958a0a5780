"""`ReusePlan`: which layers a receiver reuses from the sender and which it recomputes.

Five modes behind one interface (the first four serve requests; `swap` only profiles):
  full_prefill  no reuse; the receiver computes every layer over the whole prompt
  full_reuse    every layer's KV from the sender; only the suffix is computed
  groups        recompute each half-open group [s, e) over the context starting from the
                sender's E_s (s = 0: from the receiver's own embeddings); every other layer
                reuses the sender's KV
  cacheblend    CacheBlend-style token-level recompute: the `ratio` share of context tokens
                whose layer-0 K/V deviate most from the receiver's are recomputed through all
                layers, the rest reuse the sender's KV
A `full_reuse` or `groups` plan may also list `patch` layers (SCD's Patch, `shared/kv/scd.py`):
neither reused nor recomputed, their K/V are the receiver's own projections of the normalized
attention input decoded from the sender's E (which travels under a `lowrank` codec holding the map).
  swap          a profiling probe, not a serving mode (it saves nothing): the receiver prefills
                the context itself, then the layers in `groups` take the sender's KV instead of
                its own. "Only layer l reuses the sender's KV, every other layer is the
                receiver's own" (DroidSpeak Fig. 7) with no E at any transition, so it measures
                which layers' KV the receiver reads, apart from the E deviation groups bring
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Literal, get_args

from droidmesh.shared.errors import BadRequestError

Mode = Literal["full_prefill", "full_reuse", "groups", "cacheblend", "swap"]
MODES: tuple[Mode, ...] = get_args(Mode)


@dataclasses.dataclass(frozen=True)
class ReusePlan:
    mode: Mode
    groups: tuple[tuple[int, int], ...] = ()
    ratio: float = 0.0
    patch: tuple[int, ...] = ()  # ascending; full_reuse and groups only

    @staticmethod
    def full_prefill() -> ReusePlan:
        return ReusePlan("full_prefill")

    @staticmethod
    def full_reuse() -> ReusePlan:
        return ReusePlan("full_reuse")

    @staticmethod
    def recompute(start: int, end: int) -> ReusePlan:
        return ReusePlan.recompute_groups([(start, end)])

    @staticmethod
    def recompute_groups(groups: Iterable[tuple[int, int]]) -> ReusePlan:
        gs = tuple(sorted((int(s), int(e)) for s, e in groups))
        if not gs:
            return ReusePlan.full_reuse()
        return ReusePlan("groups", groups=gs)

    @staticmethod
    def swap(layers: Iterable[int]) -> ReusePlan:
        """Probe: the receiver's own prefill with `layers`' KV replaced by the sender's."""
        ls = sorted({int(l) for l in layers})
        if not ls:
            return ReusePlan.full_prefill()
        return ReusePlan("swap", groups=tuple((l, l + 1) for l in ls))

    def patched(self, layers: Iterable[int]) -> ReusePlan:
        """This plan with `layers` patched (a full-reuse or groups plan)."""
        return dataclasses.replace(self, patch=tuple(sorted({int(l) for l in layers})))

    @staticmethod
    def cacheblend(ratio: float) -> ReusePlan:
        return ReusePlan("cacheblend", ratio=float(ratio))

    @property
    def e_layers(self) -> tuple[int, ...]:
        """Layers whose sender E the receiver needs, ascending: each group's first layer, except
        layer 0, whose input is the receiver's own token embedding (exact, local, nothing to
        pull), and each patch layer."""
        if self.mode not in ("groups", "full_reuse"):
            return ()
        return tuple(sorted({s for s, _ in self.groups if s > 0} | set(self.patch)))

    def recomputed_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.mode == "full_prefill":
            return tuple(range(num_layers))
        listed = tuple(l for s, e in self.groups for l in range(s, e))
        if self.mode == "swap":
            return tuple(l for l in range(num_layers) if l not in listed)
        return listed

    def reused_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose KV comes from the sender (cacheblend: all, partly overwritten)."""
        if self.mode == "full_prefill":
            return ()
        own = set(self.recomputed_layers(num_layers)) | set(self.patch)
        return tuple(l for l in range(num_layers) if l not in own)

    def window_starts(self, windows: Sequence[int | None], tokens: int) -> dict[int, int]:
        """Per reused layer with a sliding window W, the first of the `tokens` context tokens any
        later query reads: max(0, tokens - W + 1), where that is past 0. A reused layer never runs
        over the context (only over the suffix, at positions >= tokens, each seeing the last W
        keys), so its K/V before that token are never read and need not be pulled. Cacheblend
        recomputes context tokens at every layer (they read the whole window behind them): none."""
        if self.mode not in ("full_reuse", "groups"):
            return {}
        starts = {l: tokens - w + 1 for l in self.reused_layers(len(windows)) if (w := windows[l]) is not None}
        return {l: s for l, s in starts.items() if s > 0}

    def validate(self, num_layers: int) -> None:
        """Raise `BadRequestError` unless the plan fits a model of `num_layers` layers."""
        if self.mode not in MODES:
            raise BadRequestError(f"unknown plan mode {self.mode!r}; expected one of {MODES}")
        if self.mode == "cacheblend" and not 0.0 <= self.ratio <= 1.0:
            raise BadRequestError(f"cacheblend ratio {self.ratio} outside [0, 1]")
        if self.patch:
            if self.mode not in ("full_reuse", "groups"):
                raise BadRequestError(f"mode {self.mode} takes no patch layers")
            recomputed = set(self.recomputed_layers(num_layers))
            if any(not 0 <= l < num_layers or l in recomputed for l in self.patch) or list(self.patch) != sorted(set(self.patch)):
                raise BadRequestError(f"patch layers {list(self.patch)}: each once, ascending, in 0..{num_layers - 1}, "
                                      "outside the recompute groups")
        if self.mode not in ("groups", "swap"):
            if self.groups:
                raise BadRequestError(f"mode {self.mode} takes no groups")
            return
        prev_end = -1
        for s, e in self.groups:
            if not 0 <= s < e <= num_layers:
                raise BadRequestError(f"group [{s}, {e}) outside 0..{num_layers} or empty")
            if s < prev_end:
                raise BadRequestError(f"groups overlap at layer {s}: {list(self.groups)}")
            prev_end = e

    def label(self) -> str:
        base = self._base_label()
        return base + " + patch " + ",".join(map(str, self.patch)) if self.patch else base

    def _base_label(self) -> str:
        if self.mode == "groups":
            return "recompute " + ",".join(f"[{s},{e})" for s, e in self.groups)
        if self.mode == "cacheblend":
            return f"cacheblend {self.ratio:.0%}"
        if self.mode == "swap":
            return "swap kv " + ",".join(str(s) for s, _ in self.groups)
        return self.mode.replace("_", " ")

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "groups": [list(g) for g in self.groups], "ratio": self.ratio, "patch": list(self.patch)}
