"""SCD calibration (offline, the profiler): fit a pair's Reuse and Patch maps on its train contexts.

Sequence: for each calibration context, both models prefill it (every layer's KV and E kept);
per layer l the running moments (`scd.Moments`) of
  (l, "K")  sender K -> receiver K, both un-rotated (pre-RoPE), per KV head
  (l, "V")  sender V -> receiver V, per KV head
  (l, "E")  sender E_l -> the receiver's normalized attention input at l (its own E_l through
            its own input norm), one head group of the hidden size
are accumulated; each is then solved once at full rank (`Fit`). `maps_for` truncates those fits to
the ranks a config asks for (a share of the fitted variance kept) and writes the maps file, so
trying another rank costs no refit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from tqdm import tqdm

from droidmesh.shared.kv import scd
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import ModelAdapter


@dataclasses.dataclass(frozen=True)
class PairFits:
    fits: dict[tuple[int, str], scd.Fit]  # (layer, "K" | "V" | "E") -> full-rank fit
    rope: scd.Rope  # the receiver's layer 0's RoPE: the maps' own
    num_layers: int
    tokens: int  # calibration tokens
    fit_s: float  # seconds: prefills + moments + solves
    meta: dict[str, str]
    ropes: tuple[scd.Rope, ...] = ()  # per receiver layer (Gemma 3: local and global bases differ); () : `rope` for all

    def rope_of(self, layer: int) -> scd.Rope:
        return self.ropes[layer] if self.ropes else self.rope


@torch.inference_mode()
def calibrate(sender: ModelAdapter, receiver: ModelAdapter, contexts: Sequence[Sequence[int]], *,
              ridge: float = 1e-3, meta: dict[str, str] | None = None, progress: bool = True,
              kinds: Sequence[str] = ("K", "V", "E")) -> PairFits:
    """Fit every layer's maps of `kinds` (default K, V and E; without "E" no patch plan can have
    maps, and the hidden-size moments and solves, the fit's largest, are skipped) for sender ->
    receiver on `contexts` (token ids); blocks."""
    if sender.fingerprint != receiver.fingerprint:
        raise ValueError("SCD maps need the same architecture on both sides")
    if not set(kinds) <= {"K", "V", "E"}:
        raise ValueError(f"kinds {list(kinds)}: expected some of K, V, E")
    t0 = time.perf_counter()
    L = receiver.num_layers
    per_kind: dict[str | None, scd.Rope] = {}  # one Rope (and its cached tables) per RoPE kind
    ropes = tuple(per_kind.setdefault(receiver.rope_kinds[l], scd.Rope(*receiver.rope_tables(l))) for l in range(L))
    e_layers = range(L) if "E" in kinds else ()
    moments: dict[tuple[int, str], scd.Moments] = defaultdict(scd.Moments)
    tokens = 0
    for ids in tqdm(contexts, desc="scd calibrate", unit="context", disable=not progress):
        cs, cr = capture_prefill(sender, ids, e_layers), capture_prefill(receiver, ids, e_layers)
        tokens += len(ids)
        for l in range(L):
            if "K" in kinds:
                rope = ropes[l]  # the receiver's, as for the maps: both sides share the architecture
                moments[(l, "K")].add(rope.unrotate(cs.kv[l].k[0].float()), rope.unrotate(cr.kv[l].k[0].float()))  # [H, T, hd]
            if "V" in kinds:
                moments[(l, "V")].add(cs.kv[l].v[0].float(), cr.kv[l].v[0].float())  # [H, T, hd]
            if "E" in kinds:
                moments[(l, "E")].add(cs.e[l].float(), receiver.attn_input(cr.e[l], l).float())  # [1, T, D]
    fits = {key: m.fit(ridge) for key, m in moments.items()}
    info = {**(meta or {}), "ridge": repr(ridge), "calibration_tokens": str(tokens)}
    return PairFits(fits, ropes[0], L, tokens, time.perf_counter() - t0, info, ropes)


def maps_for(pair: PairFits, plan: ReusePlan, share: float, patch_share: float | None = None
             ) -> tuple[scd.Maps, bytes]:
    """The maps (named by their sha256) and file bytes for `plan`: every reused layer's K and V
    coded at the smallest rank keeping `share` of the fitted variance, every patch layer's E at
    `patch_share` (default `share`)."""
    codes: dict[tuple[int, str], scd.LinearCode] = {}
    for l in plan.reused_layers(pair.num_layers):
        for kind in ("K", "V"):
            fit = pair.fits[(l, kind)]
            code = fit.truncate(fit.rank_for(share))
            if kind == "K" and not pair.rope_of(l).same(pair.rope):  # this layer's keys rotate by their own RoPE
                code = dataclasses.replace(code, rope=pair.rope_of(l))
            codes[(l, kind)] = code
    for l in plan.patch:
        if (l, "E") not in pair.fits:
            raise ValueError(f"plan {plan.label()} patches layer {l}: calibrate with kinds including 'E'")
        fit = pair.fits[(l, "E")]
        codes[(l, "E")] = fit.truncate(fit.rank_for(patch_share if patch_share is not None else share))
    meta = {**pair.meta, "share": repr(share), "patch_share": repr(patch_share), "plan": plan.label()}
    maps = scd.Maps(codes=codes, rope=pair.rope, meta=meta)
    data = maps.to_bytes()
    return dataclasses.replace(maps, sha256=hashlib.sha256(data).hexdigest()), data


def wire_bytes_per_token(maps: scd.Maps, plan: ReusePlan, num_layers: int, kv_heads: int, head_dim: int,
                         hidden: int, itemsize: int) -> int:
    """Bytes a pull under `maps` moves per context token: codes where coded, raw elsewhere."""
    total = 0
    for l in plan.reused_layers(num_layers):
        for kind in ("K", "V"):
            code = maps.code(l, kind)
            total += kv_heads * (code.rank if code is not None else head_dim) * itemsize
    for l in plan.e_layers:
        code = maps.code(l, "E")
        total += (code.rank if code is not None else hidden) * itemsize
    return total
