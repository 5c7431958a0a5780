"""`droidmesh bench layered`: the per-layer codec (`shared/profiling/layer_codecs.py`) on one pair
and plan, against the same plan sent raw, int8 and int4.

  1. on the train split's first `probe_rows` rows: the divergence pass that chooses which reused
     layers travel as int4 (the rest int8), whether the group start's E goes int8 and the int4
     layers in coarser groups, `layer_codecs.choose`; nothing of the test split;
  2. on `rows` test rows, per wire (raw, int8, int4, int4 in coarse groups with E int8, the
     choice) and full prefill: the task score
     per row; each wire's paired difference to full prefill and to the plan sent raw, bootstrap
     95 % by document, and the 5 % rule on the first; the divergence from full prefill per row
     (nats per answer token) and its paired difference to raw's;
  3. the bytes a pull of the plan moves per context token under each wire (`transfer.Layout`,
     exact per codec), against every layer's K and V sent raw in bfloat16 (what a GPU sender
     serves) and against the same plan sent raw.
Blocks on the CPU (or `device`) for as long as the rows take; `say` gets progress lines.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import layer_codecs
from droidmesh.shared.tasks import intervals
from droidmesh.shared.tasks.scorer import RAW, PairScorer, Wire

BYTES_AT = 4096  # context tokens the bytes per token are counted at (int8 K's per-channel scales are a fixed cost)


def wires(plan: ReusePlan, num_layers: int, chosen: Wire, head_dim: int) -> dict[str, Wire]:
    """The wires scored: the plan raw, every reused layer int8, int4, int4 in groups of 64 with
    the group start's E int8 (the fewest bytes step 4 of the choice can reach; where 64 divides
    the head dim), and the choice."""
    out = {"raw": RAW, **{name: layer_codecs.named_wire(name, plan, num_layers, head_dim) for name in ("int8", "int4")}}
    if layer_codecs.coarse_group(head_dim) is not None:
        coarse = layer_codecs.WIRES[2]
        out[f"int4 g{layer_codecs.COARSE_GROUP}, E int8"] = layer_codecs.named_wire(coarse, plan, num_layers, head_dim)
    return out | {"chosen": chosen}


def run(sender_path: str, receiver_path: str, task: str, group: tuple[int, int], probe_rows: int, rows: int,
        slack: float, dtype: str, device: str, say: Callable[[str], None]) -> dict[str, Any]:
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling import datasets
    from droidmesh.shared.profiling.transfer import Layout
    from droidmesh.shared.tasks.spec import task_spec

    spec = task_spec(task)
    sender = load_model(sender_path, device=device, dtype=dtype)
    receiver = load_model(receiver_path, device=device, dtype=dtype)
    L, plan = receiver.num_layers, ReusePlan.recompute(*group)
    train = PairScorer(sender, receiver, datasets.load_rows(task, "train", probe_rows), spec)
    t0 = time.perf_counter()
    coarse = layer_codecs.coarse_group(Layout.of(sender).head_dim)
    choice, section = layer_codecs.choose(lambda p, w: train.divergences(p, wire=w), plan, L, slack, coarse_group=coarse)
    section["probe_rows"], section["seconds"] = len(train.rows), time.perf_counter() - t0
    t0 = time.perf_counter()
    say(f"chosen on {len(train.rows)} train rows: int4 at layers {list(choice.int4)} ({choice.why})")
    # row by row, every wire on one capture of the row (a real-tier row's is ~150 MB: none kept)
    test = PairScorer(sender, receiver, datasets.load_rows(task, "test", rows), spec, max_captures=1)
    named = wires(plan, L, choice.wire, Layout.of(sender).head_dim)
    for i in tqdm(range(len(test.rows)), desc=f"{len(named)} wires, row by row", unit="row"):
        test.scores(ReusePlan.full_prefill(), rows=i + 1)
        for wire in named.values():
            test.scores(plan, wire, rows=i + 1)
            test.divergences(plan, rows=i + 1, wire=wire)
    full = test.scores(ReusePlan.full_prefill())
    bf16 = dataclasses.replace(Layout.of(sender), dtype=torch.bfloat16)
    every_raw = bf16.plan_bytes(ReusePlan.full_reuse(), RAW, BYTES_AT)
    out: dict[str, Any] = {"plan": plan.to_dict(), "task": task, "dtype": dtype, "rows": len(test.rows),
                           "documents": len(set(test.documents)), "full_prefill": statistics.fmean(full),
                           "layered": section, "test_seconds": time.perf_counter() - t0, "wires": {}}
    raw_scores, raw_kl = test.scores(plan, RAW), test.divergences(plan, wire=RAW)
    for name, wire in named.items():
        got, kl = test.scores(plan, wire), test.divergences(plan, wire=wire)
        vs_full = intervals.paired(full, got, groups=test.documents)
        vs_raw = intervals.paired(raw_scores, got, groups=test.documents)
        kl_vs_raw = intervals.paired(raw_kl, kl, groups=test.documents)
        nbytes = bf16.plan_bytes(plan, wire, BYTES_AT)
        out["wires"][name] = {
            "codec": wire.codec, "codec_params": dict(wire.params), "quality": statistics.fmean(got),
            "vs_full_prefill": _rel(vs_full), "verdict": vs_full.verdict(), "vs_raw": _rel(vs_raw),
            "kl_nats": statistics.fmean(kl), "kl_vs_raw_nats": [kl_vs_raw.diff, kl_vs_raw.lo, kl_vs_raw.hi],
            "bytes_per_token_bf16": nbytes / BYTES_AT, "bytes_vs_every_layer_raw_bf16": nbytes / every_raw,
            "bytes_vs_plan_raw": nbytes / bf16.plan_bytes(plan, RAW, BYTES_AT), "scores": got, "kl": kl}
        w = out["wires"][name]
        say(f"{name}: quality {w['quality']:.3f}, vs full prefill {_pct(w['vs_full_prefill'])} {w['verdict']}, "
            f"bytes {w['bytes_vs_every_layer_raw_bf16']:.3f} of every layer raw bf16")
    return out


def _rel(p: intervals.Paired) -> list[float | None]:
    return [p.rel, p.rel_lo, p.rel_hi]


def _pct(v: list[float | None]) -> str:
    """[relative difference, low, high] as "+1.0% [-2.0%, +4.0%]"."""
    return "n/a" if None in v else f"{v[0]:+.1%} [{v[1]:+.1%}, {v[2]:+.1%}]"


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per wire, for `report.format_table`."""
    return [{"wire": name, "int4_layers": len(result["layered"]["chosen"]["int4"]) if name == "chosen" else "",
             "quality": w["quality"], "vs_full_prefill": _pct(w["vs_full_prefill"]), "verdict": w["verdict"],
             "vs_raw": _pct(w["vs_raw"]), "kl_nats": w["kl_nats"], "bytes_vs_raw_bf16": w["bytes_vs_every_layer_raw_bf16"],
             "bytes_vs_plan_raw": w["bytes_vs_plan_raw"]}
            for name, w in result["wires"].items()]


def plot(result: dict[str, Any], path: str) -> None:
    """Quality against bytes, each wire with its 95 % interval against full prefill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    full = result["full_prefill"]
    for name, w in result["wires"].items():
        rel, lo, hi = w["vs_full_prefill"]
        x = w["bytes_vs_every_layer_raw_bf16"]
        if rel is not None:
            ax.errorbar([x], [1 + rel], yerr=[[rel - lo], [hi - rel]], fmt="o", capsize=4, label=name)
    ax.axhline(0.95, ls="--", c="grey", lw=1, label="95 % of full prefill")
    ax.set_xlabel("bytes per token, of every layer's K/V raw in bfloat16")
    ax.set_ylabel(f"task score / full prefill ({full:.3f})")
    ax.set_title(f"{result['task']}, plan {result['plan']['groups']}, {result['rows']} test rows")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
