"""Transfer search (the profiler, after the group search): how the chosen plan's tensors should travel.

Sequence, for the group G = [s, e) the DroidSpeak search chose (`profile.run`):
  1. calibrate the pair's SCD maps on the train split's contexts (`scd_fit.calibrate`: every
     layer's K, V and E fitted once, at full rank);
  2. list the candidate configs (`candidates`): G with its reused layers sent raw, int8, int4,
     int8 and int4 per layer as the divergence on the train probe rows allows (`layer_codecs`,
     when the inputs carry a divergence),
     or as lowrank codes keeping a share (0.8 .. 0.99) of each item's fitted variance (the rank
     is chosen per layer and kind, `Fit.rank_for`); G's layers patched instead of recomputed
     (Patch: the receiver projects a decoded E), at two E shares; G's first layer patched and
     the rest recomputed;
  3. score each on the train split (the rule: quality >= (1 - tolerance) x full prefill) and on
     the test split (reported, never used to choose);
  4. per config: the bytes a pull moves per context token under its codec, against the same
     plan sent raw (each item's `Codec.max_nbytes`, exact for every codec), and the predicted
     TTFT at a few link rates and context lengths, pipelined as the reuse policy assumes:
     max(the latency fit's recompute time, bytes / bandwidth) (`policy.prefill_seconds`; a
     patch layer's projections are not charged: they are a small fraction of one layer);
  5. `chosen_by_link`: per rate and length, the fastest config meeting the rule. The configs
     meeting it become extra frontier points of the published config (`published.recompute_config`),
     so a receiver picks among them by the bandwidth it measures.
Lowrank maps files are returned by sha256 (the caller writes `maps/<sha256>.safetensors`), never
put in the JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.kv import policy
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.profiling import layer_codecs, scd_fit
from droidmesh.shared.tasks.scorer import RAW, Wire
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire.schemas import LatencyFit

Score = Callable[[ReusePlan, Wire], float]  # mean task quality of a plan sent under a wire


@dataclasses.dataclass(frozen=True)
class Settings:
    shares: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)  # lowrank K/V: fitted variance kept
    patch_shares: tuple[float, ...] = (0.99, 0.999)  # lowrank E of patch layers
    patch_kv_share: float = 0.95  # K/V share of the reused layers in patch configs
    link_gbit_s: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.0)
    tokens: tuple[int, ...] = (1024, 4096)  # context lengths of the TTFT prediction


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the transfer search needs beyond the group search's inputs."""

    sender: ModelAdapter
    contexts: Sequence[Sequence[int]]  # calibration: the train split's context token ids
    train: Score
    test: Score
    maps_meta: dict[str, str] = dataclasses.field(default_factory=dict)  # sender_sha256 / receiver_sha256 the maps bind
    divergence: layer_codecs.Divergence | None = None  # on the train probe rows: adds the per-layer codec candidate


@dataclasses.dataclass(frozen=True)
class Layout:
    """The items a pull moves: K / V [1, kv_heads, T, head_dim] per reused layer, E [1, T, hidden]."""

    num_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype: torch.dtype  # as the sender stores them

    @staticmethod
    def of(model: ModelAdapter) -> Layout:
        fp = model.fingerprint
        return Layout(fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.hidden_size, model.dtype)

    def plan_bytes(self, plan: ReusePlan, wire: Wire, tokens: int) -> int:
        """Bytes a pull of `tokens` context tokens under `plan` and `wire` moves."""
        codec, params = codecs.get(wire.codec), dict(wire.params)
        items = [(l, k) for l in plan.reused_layers(self.num_layers) for k in ("K", "V")]
        items += [(l, "E") for l in plan.e_layers]
        total = 0
        for layer, kind in items:
            shape = (1, tokens, self.hidden) if kind == "E" else (1, self.kv_heads, tokens, self.head_dim)
            total += codec.max_nbytes(shape, self.dtype, {**params, codecs.KIND_PARAM: kind, codecs.LAYER_PARAM: layer})
        return total


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    plan: ReusePlan
    codec: str
    share: float | None = None  # lowrank: K/V variance kept
    patch_share: float | None = None  # lowrank: patch layers' E variance kept
    params: tuple[tuple[str, int | float | str], ...] = ()  # layered: the codec per layer


def candidates(group: ReusePlan, num_layers: int, settings: Settings) -> list[Candidate]:
    """The configs tried for `group` (a groups or full-reuse plan; see the module docstring)."""
    where = _groups(group) or "full reuse"
    out = [Candidate(f"{c} {where}", group, c) for c in ("raw", "int8", "int4")]
    out += [Candidate(f"lowrank s{s:g} {where}", group, "lowrank", s) for s in settings.shares]
    layers = group.recomputed_layers(num_layers)
    if not layers:
        return out
    kv = settings.patch_kv_share
    patched = ReusePlan.full_reuse().patched(layers)
    out += [Candidate(f"lowrank s{kv:g} patch {','.join(map(str, layers))} p{p:g}", patched, "lowrank", kv, p)
            for p in settings.patch_shares]
    if len(layers) > 1:  # patch the first layer, recompute the rest
        s0, e0 = group.groups[0]
        first = ReusePlan.recompute_groups([(s0 + 1, e0)] * (e0 > s0 + 1) + list(group.groups[1:])).patched([s0])
        p = max(settings.patch_shares)
        out.append(Candidate(f"lowrank s{kv:g} patch {s0} p{p:g} {_groups(first)}", first, "lowrank", kv, p))
    return out


def _groups(plan: ReusePlan) -> str:
    return " ".join(f"[{s},{e})" for s, e in plan.groups)


def profile_transfer(inputs: Inputs, receiver: ModelAdapter, group: ReusePlan, full_prefill: float, tolerance: float,
                     fit: LatencyFit, settings: Settings = Settings()) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Calibrate the pair's maps, then `search`; blocks (torch)."""
    pair_fits = scd_fit.calibrate(inputs.sender, receiver, inputs.contexts, meta=inputs.maps_meta)
    more: list[Candidate] = []
    layered: dict[str, Any] | None = None
    layout = Layout.of(inputs.sender)
    if inputs.divergence is not None:
        coarse = layer_codecs.coarse_group(layout.head_dim)
        choice, layered = layer_codecs.choose(inputs.divergence, group, receiver.num_layers, coarse_group=coarse)
        if choice.wire.codec == codecs.LAYERED.name:
            thin = (f" g{choice.group}" if choice.group else "") + (" E int8" if choice.e_codec == "int8" else "")
            more.append(Candidate(f"layered int4 x{len(choice.int4)}{thin} {_groups(group) or 'full reuse'}", group,
                                   choice.wire.codec, params=choice.wire.params))
    result, files = search(inputs.train, inputs.test, pair_fits, layout, group, full_prefill,
                           tolerance, fit, settings, more)
    result["calibration"]["contexts"] = len(inputs.contexts)
    if layered is not None:
        result["layered"] = layered
    return result, files


def search(train: Score, test: Score, pair_fits: scd_fit.PairFits, layout: Layout, group: ReusePlan,
           full_prefill: float, tolerance: float, fit: LatencyFit, settings: Settings = Settings(),
           more: Sequence[Candidate] = ()) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Score every candidate for `group` (module docstring, steps 2-5), then `more`. Returns
    the JSON section and the lowrank maps files {sha256: bytes}."""
    target = (1.0 - tolerance) * full_prefill
    files: dict[str, bytes] = {}
    rows = []
    ref = max(settings.tokens)
    for c in tqdm([*candidates(group, layout.num_layers, settings), *more], desc="transfer search", unit="config"):
        wire = RAW if c.codec == "raw" else Wire(c.codec, c.params)
        extra: dict[str, Any] = {}
        if c.codec == "lowrank":
            assert c.share is not None
            maps, data = scd_fit.maps_for(pair_fits, c.plan, c.share, c.patch_share)
            codecs.LOWRANK.add_maps(maps)  # this process's pulls (`CodedSource`) decode with it
            files[maps.sha256] = data
            wire = Wire.of("lowrank", {codecs.MAPS_PARAM: maps.sha256})
            extra = {"maps_sha256": maps.sha256, "maps_file": f"maps/{maps.sha256}.safetensors", "ranks": maps.ranks(),
                     "share": c.share, "patch_share": c.patch_share}
        q_train = train(c.plan, wire)
        q_test = test(c.plan, wire)
        wire_b, raw_b = layout.plan_bytes(c.plan, wire, ref), layout.plan_bytes(c.plan, RAW, ref)
        k = len(c.plan.recomputed_layers(layout.num_layers))
        ttft = {str(t): {f"{r:g}": predicted_ttft(fit, t, k, layout.plan_bytes(c.plan, wire, t), r)
                         for r in settings.link_gbit_s} for t in settings.tokens}
        rows.append({"name": c.name, "plan": c.plan.to_dict(), "codec": c.codec, "codec_params": dict(wire.params),
                     **extra, "recomputed_layers": k,
                     # per token at the longest predicted length (int8 K's per-channel scales are a fixed cost)
                     "wire_bytes_per_token": math.ceil(wire_b / ref), "raw_bytes_per_token": math.ceil(raw_b / ref),
                     "bytes_ratio": wire_b / raw_b if raw_b else 1.0, "quality_train": q_train, "quality_test": q_test,
                     "meets_rule": q_train >= target, "predicted_ttft_s": ttft})
    L = layout.num_layers
    return {
        "group": group.to_dict(),
        "calibration": {"tokens": pair_fits.tokens, "fit_s": pair_fits.fit_s, "ridge": pair_fits.meta.get("ridge")},
        "rule": {"full_prefill_train": full_prefill, "tolerance": tolerance, "target": target},
        "link_gbit_s": list(settings.link_gbit_s), "tokens": list(settings.tokens),
        "ttft_model": "max(latency fit at the recomputed layers, wire bytes / link rate); patch projections not charged",
        "full_prefill_ttft_s": {str(t): policy.prefill_seconds(fit, t, L) for t in settings.tokens},
        "configs": rows,
        "chosen_by_link": chosen_by_link(rows, settings),
    }, files


def predicted_ttft(fit: LatencyFit, tokens: int, recomputed: int, nbytes: int, gbit_s: float) -> float:
    """Pipelined: the recompute overlaps the pull, so the slower of the two."""
    return max(policy.prefill_seconds(fit, tokens, recomputed), nbytes * 8 / (gbit_s * 1e9))


def chosen_by_link(rows: list[dict[str, Any]], settings: Settings) -> dict[str, dict[str, str | None]]:
    """{rate: {tokens: the fastest config meeting the rule (ties: fewer wire bytes), or None}}."""
    ok = [r for r in rows if r["meets_rule"]]
    return {f"{rate:g}": {str(t): min(ok, key=lambda r: (r["predicted_ttft_s"][str(t)][f"{rate:g}"],
                                                         r["wire_bytes_per_token"]))["name"] if ok else None
                          for t in settings.tokens}
            for rate in settings.link_gbit_s}
