"""Pulls between hosts, modelled: a plan's bytes against the link, the path its bytes take with
and without GPUDirect RDMA, and whether relaying pays (`droidmesh bench hosts`).

No second host can be reached from this project's machines, so this is arithmetic over measured
inputs, not a measurement:
  * bytes per plan: the codec registry's own sizes (`codecs.get(c).max_nbytes`) for each item a
    plan pulls (`pull.pull_items`), at a named shape's widths (`shared/model/shapes.py`), bf16;
  * the path (`PATHS`), per item in pull order, E first:
      gpudirect  the NIC reads the sender's device memory and writes the receiver's (RDMA with
                 GPUDirect at both ends): the link or the NIC's PCIe, whichever is slower;
      staged     no GPUDirect: each item is copied device to pinned host at the sender, sent, and
                 copied pinned host to device at the receiver, per item, the three stages
                 overlapping (a pinned staging pool of a few items per pull at each end): the slower
                 of link and PCIe, plus the first item's copy out and the last one's copy in;
      today      what the ucx and nixl channels do now for a context held on a device: each item
                 is copied to pinned host memory (`RawCodec.encode`), then the whole plan into one
                 per-pull memfd (`sandbox/regions.export`) before the grant, then sent; the
                 receiver stages each item in pinned memory and copies it in. That export's rate
                 is an input (`Rates.export_gbs`): the one measurement of this path on a GPU, the
                 nixl channel between two processes on one H200, moved device memory at 2.1-2.9
                 GB/s end to end, so that is the default;
      host_held  today's path for a context the sender's store moved to host memory (its placed
                 memfd is sent as it lies): no copy out;
  * the engine (optional): a `check.sh` JSON's rows measured on a GPU, by recomputed layers (the
    full prefill, full reuse, k = 2), layer graphs' rows where there are any;
  * TTFT through the mesh in the form the receiver's policy predicts it (`policy._weigh`): the
    fixed cost (grant and request) + max(the engine's own time, the pull's).
Encoding and decoding times of a codec are not modelled (on a GPU a coded item is made on the
device and sent from pinned host memory, so coded rows are host paths: no `gpudirect` row).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.pull import pull_items
from droidmesh.shared.wire.schemas import CodecParams

PATHS = ("gpudirect", "staged", "today", "host_held")
PLANS = ("full reuse", "k = 2 with E")
ENGINE_PLANS = {"full reuse": 0, "k = 2 with E": 2}  # the engine row each plan reads, by recomputed layers
TARGETS = {"full reuse": 2.0, "k = 2 with E": 1.2}  # mesh over engine alone, as for one GPU


@dataclasses.dataclass(frozen=True)
class Widths:
    """What a pull's bytes depend on: layers, KV heads x head dim, hidden size (bf16)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int


@dataclasses.dataclass(frozen=True)
class Link:
    """A path's rates in bytes/s and its fixed cost: the link (Gbit/s x efficiency), pinned PCIe
    copies between host and device, today's export of a plan into a per-pull memfd, the grant and
    request before the first byte."""

    link_bps: float
    pcie_bps: float
    export_bps: float
    fixed_s: float


def widths(shape: str) -> Widths:
    """A named shape's widths (its config, no model built)."""
    from droidmesh.shared.model.shapes import SHAPES  # transformers: only this suite pays for it

    if shape not in SHAPES:
        raise BadRequestError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    c = SHAPES[shape][1]
    return Widths(c["num_hidden_layers"], c["num_key_value_heads"],
                  c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), c["hidden_size"])


def named_plan(name: str, layers: int) -> ReusePlan:
    """Full reuse, or two layers recomputed from the middle one's E (the E is pulled first)."""
    if name == "full reuse":
        return ReusePlan.full_reuse()
    mid = layers // 2
    return ReusePlan.recompute(mid, mid + 2)


def item_bytes(w: Widths, plan: ReusePlan, tokens: int, codec: str) -> list[int]:
    """Wire bytes of each item `plan` pulls, in pull order: E [1, T, D], K / V [1, kvh, T, hd]."""
    out = []
    for it in pull_items(plan, w.layers):
        shape = (1, tokens, w.hidden) if it.kind == "E" else (1, w.kv_heads, tokens, w.head_dim)
        params: CodecParams = {} if codec == "raw" else {codecs.KIND_PARAM: it.kind}
        out.append(codecs.get(codec).max_nbytes(shape, torch.bfloat16, params))
    return out


def pull_seconds(path: str, items: Sequence[int], link: Link) -> float:
    """A pull's time on `path` (module docstring), its fixed cost included."""
    total = sum(items)
    wire = total / min(link.link_bps, link.pcie_bps)  # the NIC reads and writes over PCIe too
    last_in = items[-1] / link.pcie_bps if items else 0.0  # the last item's copy in, after it lands
    if path == "gpudirect":
        return link.fixed_s + wire
    if path == "staged":
        return link.fixed_s + items[0] / link.pcie_bps + wire + last_in
    if path == "today":
        return link.fixed_s + total / link.export_bps + wire + last_in
    if path == "host_held":
        return link.fixed_s + wire + last_in
    raise BadRequestError(f"unknown path {path!r}; known: {', '.join(PATHS)}")


def mesh_ttft(pull_s: float, engine_s: float, fixed_s: float) -> float:
    """The policy's prediction: the fixed cost, then the engine and the pull overlapped."""
    return fixed_s + max(engine_s, pull_s - fixed_s)


def least_link(ok: Callable[[float], bool], lo: float = 0.01, hi: float = 100_000.0) -> float | None:
    """The smallest link rate (Gbit/s, to 0.1 %) at which `ok` holds, `ok` rising with the rate;
    None when it fails even at `hi` (another stage is the limit)."""
    if not ok(hi):
        return None
    if ok(lo):
        return lo
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def engine_rows(path: str | Path) -> dict[tuple[int, int], float]:
    """(context, recomputed layers) -> TTFT seconds from a `check.sh` JSON; a context's rows with
    layer graphs replace its eager ones."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise BadRequestError(f"{path}: not a GPU check's JSON (no rows)")
    out: dict[tuple[int, int], tuple[bool, float]] = {}
    for r in rows:
        key = (int(r["context"]), int(r["recomputed_layers"]))
        graphs = bool(r.get("graphs", False))
        if key not in out or graphs > out[key][0]:
            out[key] = (graphs, float(r["ttft_s"]))
    return {k: v[1] for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Rates:
    """What every path shares: pinned PCIe copies between host and device and today's export of a
    plan into a per-pull memfd (GB/s), the fixed cost before a pull's first byte (ms) and the
    share of a link's rate a pull gets."""

    pcie_gbs: float
    export_gbs: float
    fixed_ms: float
    efficiency: float

    def link(self, gbit_s: float) -> Link:
        return Link(gbit_s * 1e9 / 8 * self.efficiency, self.pcie_gbs * 1e9, self.export_gbs * 1e9,
                    self.fixed_ms / 1e3)


@dataclasses.dataclass(frozen=True)
class Case:
    """One context, plan and codec of a shape: its items' bytes and the engine's measured times."""

    context: int
    plan: str
    codec: str
    items: list[int]
    alone_s: float | None  # the engine with the sender's cache in memory
    prefill_s: float | None  # the receiver's full prefill

    def head(self, shape: str, path: str) -> dict[str, Any]:
        return {"shape": shape, "context": self.context, "plan": self.plan, "codec": self.codec, "path": path,
                "items": len(self.items), "wire_mb": sum(self.items) / 1e6}


def cases(shape: str, contexts: Sequence[int], codec_names: Sequence[str],
          engine: dict[tuple[int, int], float] | None) -> list[tuple[Case, tuple[str, ...]]]:
    """Every (context, plan, codec) of `shape` with the paths it takes (a coded item is host memory
    on a GPU sender today: no `gpudirect`)."""
    w = widths(shape)
    out = []
    for tokens in contexts:
        for plan in PLANS:
            for codec in codec_names:
                case = Case(tokens, plan, codec, item_bytes(w, named_plan(plan, w.layers), tokens, codec),
                            engine.get((tokens, ENGINE_PLANS[plan])) if engine else None,
                            engine.get((tokens, w.layers)) if engine else None)
                out.append((case, PATHS if codec == "raw" else tuple(p for p in PATHS if p != "gpudirect")))
    return out


def rows(shape: str, contexts: Sequence[int], codec_names: Sequence[str], gbit_s: Sequence[float], rates: Rates,
         engine: dict[tuple[int, int], float] | None) -> list[dict[str, Any]]:
    """One row per context, plan, codec, path and link: bytes, the pull and, with `engine`, the TTFT
    through the mesh against the engine alone and the full prefill."""
    out = []
    for case, paths in cases(shape, contexts, codec_names, engine):
        for path in paths:
            for g in gbit_s:
                link = rates.link(g)
                pull = pull_seconds(path, case.items, link)
                mesh = mesh_ttft(pull, case.alone_s, link.fixed_s) if case.alone_s is not None else None
                out.append({**case.head(shape, path), "link_gbit_s": g, "pull_s": pull, "engine_s": case.alone_s,
                            "mesh_s": mesh, "full_prefill_s": case.prefill_s,
                            "mesh_over_engine": mesh / case.alone_s if mesh is not None and case.alone_s else None,
                            "relay_pays": mesh < case.prefill_s if mesh is not None and case.prefill_s else None})
    return out


def break_even(shape: str, contexts: Sequence[int], codec_names: Sequence[str], rates: Rates,
               engine: dict[tuple[int, int], float] | None) -> list[dict[str, Any]]:
    """Per context, plan, codec and path: the least link rate (Gbit/s) at which relaying beats the
    full prefill, and at which the mesh keeps within its target of the engine alone (`TARGETS`);
    without the engine's times, the pull's own time at 100 Gbit/s (what a prefill must exceed)."""
    out = []
    for case, paths in cases(shape, contexts, codec_names, engine):
        for path in paths:
            def mesh(g: float, case: Case = case, path: str = path) -> float:
                link = rates.link(g)
                return mesh_ttft(pull_seconds(path, case.items, link), case.alone_s or 0.0, link.fixed_s)

            row = case.head(shape, path)
            if case.alone_s is None:
                row["pull_at_100g_s"] = pull_seconds(path, case.items, rates.link(100.0))
                out.append(row)
                continue
            target = TARGETS[case.plan] * case.alone_s

            def within(g: float, mesh: Callable[[float], float] = mesh, target: float = target) -> bool:
                return mesh(g) <= target

            if case.prefill_s is not None:
                def pays(g: float, mesh: Callable[[float], float] = mesh, prefill: float = case.prefill_s) -> bool:
                    return mesh(g) < prefill

                row["pays_from_gbit_s"] = least_link(pays)
            row["target_from_gbit_s"] = least_link(within)
            out.append(row)
    return out
