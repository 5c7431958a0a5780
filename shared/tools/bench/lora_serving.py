"""`droidmesh bench adapters`: resident memory of N fine-tunes served as N merged models vs as
unmerged adapters over one copy of their base (`shared/model/lora.py`), and the compute
overhead of the unmerged LoRA on a full prefill.

Every layout is loaded in its own fresh interpreter (this module run with `-m`), so its resident
set holds that layout alone: what torch, transformers and peft cost after import
(`rss_import_mib`), after loading (`rss_loaded_mib`) and after one short forward through every
served view (`rss_mib`, the figure compared), plus the peak (`hwm_mib`). Layouts:
  - merged: `load_model` of one adapter directory (base + adapter merged), one served model;
  - adapter_set: `AdapterSet.load` of the base with N adapters, N + 1 served models (the base
    view comes free);
  - merged_processes: N x merged, the estimate for serving the same N fine-tunes as N processes
    (not run: N copies of one measured process). Its `rss_mib` (N x RSS) is what N hosts or N
    memory-limited containers hold. On one host the processes share their file-backed pages (the
    libraries, and the base's safetensors, which transformers maps: every weight a merge did not
    write stays a page of that file), so there they hold N x anonymous + file once
    (`host_mib`).
Adapters beyond those given are random LoRAs of the first one's shapes and config, written to a
temporary directory: resident memory depends on tensor shapes, not values.

The prefill timing runs in one more process holding the merged model and the largest set: the
median of `repeats` full prefills (after one warm-up round) of `tokens` tokens of real text (a
Python standard library module's source) under the merged model, the same adapter's view and the
base view, alternated round by round, in wall time (TTFT) and in the process's CPU time (with
one thread, the prefill's compute: steadier than wall time where other processes share the CPUs).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULT_PREFIX = "ADAPTERS "  # the child's one result line: this prefix, then JSON
SHORT_FORWARD_TOKENS = 16
TEXT_MODULE = "argparse"  # the prefill's text: this standard library module's source
SYNTHETIC_NOTE = ("adapters marked synthetic are random LoRAs with the shapes and config of the first real one: "
                  "resident memory depends on tensor shapes, not values")


def rss() -> dict[str, float]:
    """This process's resident set (MiB): total, anonymous, file-backed, and its peak."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "hwm"}
    status = Path("/proc/self/status")
    if not status.is_file():  # not Linux: psutil's total only
        import psutil

        return {"rss": psutil.Process().memory_info().rss / 2**20}
    out = {}
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[fields[key]] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def synthetic_adapter(template: Path, base: Path, out: Path, seed: int) -> Path:
    """A random LoRA in `out` with `template`'s tensor shapes, dtypes and config, on `base`."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(template / "adapter_model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype) for k, t in tensors.items()},
              str(out / "adapter_model.safetensors"))
    cfg = json.loads((template / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(base.resolve())}, indent=2))
    return out


def measure(base: Path, adapters: Sequence[tuple[str, Path]], counts: Sequence[int], tokens: int, repeats: int,
            device: str, dtype: str | None, threads: int, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run every layout in its own process, then the timing process; return the rows, the
    prefill timings and what was loaded."""
    with tempfile.TemporaryDirectory(prefix="dm-bench-adapters-") as work:
        return _measure(base, list(adapters), Path(work), counts, tokens, repeats, device, dtype, threads, log)


def _measure(base: Path, adapters: list[tuple[str, Path]], work: Path, counts: Sequence[int], tokens: int, repeats: int,
             device: str, dtype: str | None, threads: int, log: Callable[[str], Any]) -> dict[str, Any]:
    named = list(adapters)
    for i in range(len(named), max(counts)):
        named.append((f"synthetic{i + 1}", synthetic_adapter(named[0][1], base, work / f"synthetic{i + 1}", seed=i)))
    common = {"base": str(base), "device": device, "dtype": dtype, "threads": threads, "tokens": tokens,
              "repeats": repeats}
    log(f"merged: load_model({named[0][1]})")
    merged = _child({**common, "layout": "merged", "adapters": _spec(named[:1])})
    rows = [_row("merged", 1, 1, merged, merged)]
    for n in counts:
        log(f"adapter_set: base + {n} adapter(s)")
        rows.append(_row("adapter_set", n, n + 1, _child({**common, "layout": "adapter_set", "adapters": _spec(named[:n])}),
                         merged))
        alone = merged["after_forward"]
        anon, file = alone.get("anon", alone["rss"]), alone.get("file", 0.0)
        rows.append({"layout": "merged_processes", "adapters": n, "served_models": n, "rss_mib": n * alone["rss"],
                     "ratio_to_one_merged": float(n), "anon_mib": n * anon, "file_mib": file, "host_mib": n * anon + file,
                     "estimate": True})
    log(f"timing: merged {named[0][0]} vs its view in a set of {max(counts)} adapters, {tokens} tokens x {repeats}")
    timing = _child({**common, "layout": "timing", "adapters": _spec(named[:max(counts)])})
    seconds, cpu = timing["prefill_s"], timing["prefill_cpu_s"]
    prefill = {"tokens": timing["prefill_tokens"], "text": f"the source of Python's {TEXT_MODULE} module",
               "repeats": repeats, "seconds": seconds, "cpu_seconds": cpu, "runs": timing["prefill_runs"],
               "view_over_merged": seconds["view"] / seconds["merged"],
               "base_view_over_merged": seconds["base_view"] / seconds["merged"],
               "cpu_view_over_merged": cpu["view"] / cpu["merged"],
               "cpu_base_view_over_merged": cpu["base_view"] / cpu["merged"],
               "lora_macs_share": timing["lora_macs_share"],
               "adapter": named[0][0], "set_adapters": max(counts)}
    log(f"receiver processes: one merged model vs the base with {max(counts)} adapters")
    receivers = measure_receivers(base, named[:max(counts)], work / "receivers", device, dtype, threads)
    return {"rows": rows, "prefill": prefill, "receivers": receivers, "base": str(base),
            "adapters": [{"name": n, "path": None if i >= len(adapters) else str(p), "synthetic": i >= len(adapters)}
                         for i, (n, p) in enumerate(named)],
            "note": SYNTHETIC_NOTE if len(named) > len(adapters) else None}


def measure_receivers(base: Path, adapters: Sequence[tuple[str, Path]], log_dir: Path, device: str,
                      dtype: str | None, threads: int) -> list[dict[str, Any]]:
    """The same comparison as real receiver processes (a nats-server, a receiver ready: its model,
    its KV screen's reference prefill, NATS and the bulk channel, holding on): one serving a merged
    adapter, one serving the base with every adapter; RSS of each once ready."""
    import psutil

    from droidmesh.shared.service.launch import start_nats, start_service

    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "DM_DEVICE": device,
           **({"DM_DTYPE": dtype} if dtype else {}), "DM_METRICS_PORT": "-1"}
    layouts = [("merged", {"model_path": adapters[0][1], "model_id": adapters[0][0]}, 1),
               ("adapter_set", {"model_path": base, "model_id": "base",
                                "adapters": [f"{n}={p}" for n, p in adapters]}, len(adapters) + 1)]
    log_dir.mkdir(parents=True, exist_ok=True)
    nats, url = start_nats(store_dir=str(log_dir / "js"), log_dir=log_dir)
    rows: list[dict[str, Any]] = []
    try:
        for layout, args, served in layouts:
            proc = start_service("receiver", {**args, "transport": "shm"}, url, name=f"receiver-{layout}", env=env,
                                 log_dir=log_dir, timeout=600)
            try:
                mib = psutil.Process(proc.popen.pid).memory_info().rss / 2**20
            finally:
                proc.stop()
            rows.append({"layout": f"receiver_{layout}", "adapters": len(adapters) if layout == "adapter_set" else 1,
                         "served_models": served, "rss_mib": round(mib, 1)})
    finally:
        nats.stop()
    for r in rows:
        r["ratio_to_one_merged"] = round(r["rss_mib"] / rows[0]["rss_mib"], 3)
    return rows


def _spec(adapters: Sequence[tuple[str, Path]]) -> list[list[str]]:
    return [[n, str(p)] for n, p in adapters]


def _row(layout: str, n: int, served: int, got: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    after = got["after_forward"]
    return {"layout": layout, "adapters": n, "served_models": served, "rss_mib": after["rss"],
            "ratio_to_one_merged": after["rss"] / merged["after_forward"]["rss"],
            "rss_import_mib": got["after_import"]["rss"], "rss_loaded_mib": got["after_load"]["rss"],
            "anon_mib": after.get("anon"), "file_mib": after.get("file"), "host_mib": after["rss"],
            "hwm_mib": after.get("hwm"),
            "load_s": got["load_s"], "estimate": False}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one layout in a fresh interpreter; its result line as a dict."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    out = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], capture_output=True, text=True,
                         timeout=3600, env=env)
    line = next((l for l in out.stdout.splitlines() if l.startswith(RESULT_PREFIX)), None)
    if line is None:
        raise RuntimeError(f"{spec['layout']} process failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(line[len(RESULT_PREFIX):])


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In the child: import, load the layout, one short forward per served view, reading resident
    memory at each stage; or (layout "timing") the merged model and the set side by side, their
    prefills alternated round by round so that load from other processes hits both alike."""
    import gc
    import time

    import peft  # noqa: F401  # imported in every layout, so the import baseline is the same
    import torch

    from droidmesh.shared.kv.partial import generate
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.adapter import ModelAdapter, load_model
    from droidmesh.shared.model.lora import AdapterSet

    torch.set_num_threads(spec["threads"])
    result: dict[str, Any] = {"after_import": rss()}
    t0 = time.perf_counter()
    adapters = [(n, Path(p)) for n, p in spec["adapters"]]
    views: dict[str, ModelAdapter] = {}
    if spec["layout"] in ("merged", "timing"):
        views["merged"] = load_model(adapters[0][1], device=spec["device"], dtype=spec["dtype"])
    if spec["layout"] in ("adapter_set", "timing"):
        aset = AdapterSet.load(spec["base"], adapters, device=spec["device"], dtype=spec["dtype"], base_name="base")
        views.update({"view": aset.view(adapters[0][0]), "base_view": aset.view("base"),
                      **{f"view:{n}": aset.view(n) for n, _ in adapters[1:]}})
    result["load_s"] = time.perf_counter() - t0
    gc.collect()
    result["after_load"] = rss()
    tok = next(iter(views.values())).tokenizer
    if tok is None:
        raise RuntimeError(f"{spec['base']} has no tokenizer: the timed prefill reads text")
    text = Path(importlib.import_module(TEXT_MODULE).__file__ or "").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"][:spec["tokens"]]
    for view in views.values():
        generate(view, ids[:SHORT_FORWARD_TOKENS], ReusePlan.full_prefill(), max_new_tokens=1)
    gc.collect()
    result["after_forward"] = rss()
    if spec["layout"] == "timing":
        result.update(_prefill_times(views, ids, spec["repeats"]))
        # An unmerged LoRA adds one multiply-add per token per LoRA weight (x A^T, then B): its
        # share of the decoder layers' own weights is its share of their multiply-adds.
        layers = views["merged"].model.model.layers
        own = sum(p.numel() for p in layers.parameters())
        result["lora_macs_share"] = aset.added_params(adapters[0][0]) / own
    return result


def _prefill_times(views: dict[str, Any], ids: list[int], repeats: int) -> dict[str, Any]:
    """The timing layout's prefills: the merged model and the set's views alternated round by
    round, the first round a warm-up; each run's wall and CPU seconds, and their medians.
    Wall time is the TTFT a request sees; with one torch thread the CPU time is the prefill's own
    compute, which other processes' load on a shared machine stretches far less."""
    import statistics
    import time

    from droidmesh.shared.kv.partial import generate
    from droidmesh.shared.kv.plan import ReusePlan

    timed = ("merged", "view", "base_view")
    wall: dict[str, list[float]] = {name: [] for name in timed}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name in timed:
            c0 = time.process_time()
            wall[name].append(generate(views[name], ids, ReusePlan.full_prefill(), max_new_tokens=1).ttft_s)
            cpu[name].append(time.process_time() - c0)
    return {"prefill_tokens": len(ids),
            "prefill_runs": {"wall": {n: r[1:] for n, r in wall.items()}, "cpu": {n: r[1:] for n, r in cpu.items()}},
            "prefill_s": {n: statistics.median(r[1:]) for n, r in wall.items()},
            "prefill_cpu_s": {n: statistics.median(r[1:]) for n, r in cpu.items()}}


def plot(result: dict[str, Any], path: str) -> None:
    from droidmesh.shared import report

    plt = report.pyplot()

    rows = result["rows"]
    sets = [r for r in rows if r["layout"] == "adapter_set"]
    procs = [r for r in rows if r["layout"] == "merged_processes"]
    merged = next(r for r in rows if r["layout"] == "merged")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    xs = list(range(len(sets)))
    w = 0.27
    for i, (part, key, label) in enumerate([
            (sets, "rss_mib", "one process: base + N adapters"),
            (procs, "rss_mib", "N merged processes: N x RSS"),
            (procs, "host_mib", "N merged processes on one host: N x anon + shared file pages")]):
        bars = a.bar([x + (i - 1) * w for x in xs], [r[key] for r in part], w, label=label, hatch="//" if i == 2 else None)
        report.label_bars(a, bars, "{:.0f}")
    a.axhline(merged["rss_mib"], c="k", ls=":", label=f"one merged model ({merged['rss_mib']:.0f} MiB)")
    a.set_xticks(xs, [f"N={r['adapters']}" for r in sets])
    a.set_ylabel("resident memory (MiB)")
    a.set_title("Serving N fine-tunes of one base")
    a.set_ylim(0, 1.3 * max(r["rss_mib"] for r in rows))
    a.legend(fontsize=7, loc="upper left")
    pre = result["prefill"]
    names = ["merged", "view", "base_view"]
    labels = [f"merged {pre['adapter']}", f"{pre['adapter']} view\n(unmerged)", "base view"]
    for i, (key, label) in enumerate([("seconds", "wall (TTFT)"), ("cpu_seconds", "CPU time")]):
        bars = b.bar([x + (i - 0.5) * 0.4 for x in range(3)], [pre[key][n] for n in names], 0.4, label=label)
        report.label_bars(b, bars, "{:.2f}")
    b.set_xticks(range(3), labels)
    b.set_ylabel("full prefill (s, median)")
    b.set_title(f"{pre['tokens']}-token prefill, view / merged: wall {pre['view_over_merged']:.3f}, "
                f"CPU {pre['cpu_view_over_merged']:.3f}", fontsize=8)
    b.tick_params(axis="x", labelsize=7)
    b.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_run_child(json.loads(sys.argv[1]))), flush=True)
