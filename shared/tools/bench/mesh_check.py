"""The whole mesh on one device: TTFT through the mesh against the engine alone, per shape,
context, plan and bulk channel: `python -m droidmesh.shared.tools.bench.mesh_check` (run by
`infra/gpu/mesh-check.sh`; `--tiny` on the CPU is what CI runs).

Sequence, per named shape (`model/shapes.py`; random weights, `zoo/shapes.write_checkpoint`):
  1. a real nats-server (users per role, no anonymous access) and, per channel, one sender
     process on the shape's checkpoint serving over that channel (E captured at the k = 2 group's
     start), a store sized for every context;
  2. the receiver side in a child process (`probe.probe_configs`, same checkpoint: same weights),
     per context one fresh context the sender prefills, then per plan (full reuse; k = 2 of L with
     E, at the middle layers) three timings, median of `--repeats` after a warm-up round:
     `mesh_s` (the pull streaming in while the engine runs: what a receiver does), `engine_s`
     (the engine alone, every tensor pulled beforehand: the sender's cache already in memory) and
     `pull_s` (the pull alone), with the bytes moved; and the full prefill once per context;
  3. rows in a table, the targets (Llama-3-8B shape at 32K: k = 2 through the mesh <= 1.2x the
     engine alone, full reuse <= 2x; SmolLM2 shape at 2K: k = 2 through the mesh faster than its
     full prefill), JSON to `--json` (else `$OUT/mesh-check.json` when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from droidmesh.shared import report
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.mesh.nats_auth import Roster, sender_user
from droidmesh.shared.model.shapes import SHAPES
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import launched_env, mesh
from droidmesh.shared.tools.bench.harness import held_bytes_per_token, run_probe_configs
from droidmesh.shared.zoo.shapes import write_checkpoint


class Defaults(NamedTuple):
    shapes: list[str]
    contexts: list[int]
    channels: list[str]
    repeats: int


GPU = Defaults(["llama3-8b", "smollm2-135m"], [4096, 8192, 16384, 32768], ["shm", "ucx"], 3)
TINY = Defaults(["tiny"], [64], ["shm"], 1)
MODES = ("mesh", "engine", "pull")  # the row's columns, from the probe's config modes
_PROBE_MODE = {"mesh": "mesh", "engine": "local", "pull": "transfer"}


def plans(layers: int) -> dict[str, ReusePlan]:
    """The plans timed: full reuse, and k = 2 of `layers` at the middle (with E at its start)."""
    g = layers // 2 - 1
    return {"full reuse": ReusePlan.full_reuse(), f"k=2 [{g},{g + 2})": ReusePlan.recompute(g, g + 2)}


def configs(layers: int) -> list[dict[str, Any]]:
    """The probe's configs: full prefill, then per plan and mode one raw-codec config."""
    out = [{"name": "full prefill", "plan": ReusePlan.full_prefill().to_dict(), "codec": "raw"}]
    for label, plan in plans(layers).items():
        out += [{"name": f"{label}|{m}", "plan": plan.to_dict(), "codec": "raw", "mode": _PROBE_MODE[m]} for m in MODES]
    return out


def rows_of(shape: str, channel: str, probed: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (context, plan) from the probe's rows (one per context and config)."""
    by: dict[tuple[int, str], dict[str, Any]] = {(r["target_tokens"], r["config"]): r for r in probed["rows"]}
    contexts = sorted({n for n, _ in by})
    out = []
    for n in contexts:
        prefill = by[(n, "full prefill")]["ttft_s"]
        for label in plans(probed["total_layers"]):
            got = {m: by[(n, f"{label}|{m}")] for m in MODES}
            mesh_s, engine_s = got["mesh"]["ttft_s"], got["engine"]["ttft_s"]
            out.append({"shape": shape, "channel": channel, "context": n, "tokens": got["mesh"]["tokens"], "plan": label,
                        "prefill_s": prefill,
                        "mesh_s": mesh_s, "engine_s": engine_s, "pull_s": got["pull"]["ttft_s"],
                        "bytes": got["mesh"]["bytes_total"],
                        "mesh_over_engine": mesh_s / engine_s if mesh_s and engine_s else None,
                        "prefill_over_mesh": prefill / mesh_s if prefill and mesh_s else None,
                        "error": "; ".join(e for e in (g["error"] for g in got.values()) if e) or None})
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def ratio(shape: str, n: int, k2: bool, key: str) -> float | None:
        found = [r[key] for r in rows if r["shape"] == shape and r["context"] == n and r["plan"].startswith("k=2") == k2]
        return min((v for v in found if v is not None), default=None)  # the best channel

    return {"llama3_8b_32k_k2_mesh_over_engine": ratio("llama3-8b", 32768, True, "mesh_over_engine"),  # <= 1.2
            "llama3_8b_32k_full_reuse_mesh_over_engine": ratio("llama3-8b", 32768, False, "mesh_over_engine"),  # <= 2
            "smollm2_2k_k2_prefill_over_mesh": ratio("smollm2-135m", 2048, True, "prefill_over_mesh")}  # > 1


def run_shape(shape: str, contexts: list[int], channels: list[str], repeats: int, device: str, work: Path
              ) -> list[dict[str, Any]]:
    """Steps 1-2 for one shape: its rows, every channel's."""
    ckpt = str(write_checkpoint(shape, work / shape))
    layers = SHAPES[shape][1]["num_hidden_layers"]
    g = layers // 2 - 1
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    senders = [f"mesh-{c}" for c in channels]
    rows: list[dict[str, Any]] = []
    with mesh(Roster.local(senders, [])) as (access, procs):
        for channel, sid in zip(channels, senders, strict=True):
            procs.append(start_service("sender", {
                "model_path": ckpt, "model_id": sid, "sender_id": sid, "dtype": dtype, "e_layers": [g],
                "transport": channel,
                "store_bytes": max(1 << 30, 2 * held_bytes_per_token(Path(ckpt), dtype, 1) * sum(contexts))},
                access.url, env={**launched_env(device), **access.env_for(sender_user(sid))}))
        for channel, sid in zip(channels, senders, strict=True):
            try:
                probed = run_probe_configs(access, ckpt, sid, contexts, configs(layers), repeats, device, dtype)
            except Exception as e:  # a channel that cannot run is a row that says why, not a lost check
                rows.append({"shape": shape, "channel": channel, "context": None, "plan": None,
                             "error": f"{type(e).__name__}: {e}"[-500:]})
                continue
            rows += rows_of(shape, channel, probed)
            print(report.format_table(rows[-len(contexts) * 2:], COLUMNS), flush=True)
    return rows


COLUMNS = ["shape", "channel", "context", "plan", "prefill_s", "mesh_s", "engine_s", "pull_s", "mesh_over_engine",
           "prefill_over_mesh", "bytes", "error"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.mesh_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, one short context, shm, on the CPU (CI)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default {','.join(GPU.shapes)})")
    ap.add_argument("--contexts", help="tokens, comma-separated (default 4096,8192,16384,32768)")
    ap.add_argument("--channels", help="bulk channels, comma-separated (default shm,ucx)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    base = TINY if args.tiny else GPU
    shapes = args.shapes.split(",") if args.shapes else base.shapes
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else base.contexts
    channels = args.channels.split(",") if args.channels else base.channels
    device = "cpu" if args.tiny else args.device
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mesh-check-") as work:
        for shape in shapes:
            rows += run_shape(shape, contexts, channels, args.repeats or base.repeats, device, Path(work))
    out = {"suite": "mesh_check", "machine": report.machine(), "device": device, "rows": rows, "targets": targets(rows)}
    print(report.format_table(rows, COLUMNS))
    print(json.dumps({"targets": out["targets"]}, indent=1))
    path = args.json or (Path(os.environ["OUT"]) / "mesh-check.json" if os.environ.get("OUT") else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
