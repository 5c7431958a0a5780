"""Pulls between two processes on one GPU over the UCX and shm channels, against the device's own
copy bandwidth: `python -m droidmesh.shared.tools.bench.gpu_transfer` (run by `infra/gpu/transfer-check.sh`).

Sequence:
  1. facts: torch and its CUDA device, whether UCX here can move device memory
     (`capabilities.ucx_cuda_support`), and the transports UCX runs with: DroidMesh's options
     (`shared.transport.ucx.ucx_options`) name cuda_copy and cuda_ipc wherever CUDA is available,
     in this process and the server's alike; an operator's `UCX_TLS` wins. Without CUDA, or with
     `--dry-run`, every later step runs the same way on CPU tensors of tiny sizes;
  2. the reference per size: `dst.copy_(src)` on the device, timed with CUDA events
     (`perf_counter` on the CPU), one warm-up, then the median of `--repeats`;
  3. a tensor server in a child process (`tensor_proc.TensorServer`: `shared.tools.bench.tensor_server
     ucx SIZES --device D`, with `UCX_PROTO_INFO=y`) holding one bf16 tensor per size on the device;
  4. per size, pulls from it over the UCX channel into one preallocated buffer on the same device
     (`bulk_transfer.pull_rates`): one warm-up, then the median wall time of `--repeats` (a pull ends
     when its payload has landed and passed its checksum); the path the capability check gives
     and the protocol UCX printed for sending that memory (`ucx_proto.ucx_tables`);
  5. the same over the shm channel (`shm_rows`: device exports opened once by the receiver; per
     size, a 60-item plan in one pull, and the fixed cost of a 4 KiB pull); with `--channels nixl`,
     first the re-export probe (`nixl_reexport`: can NIXL in a sandbox serve memory it holds only as
     an import?), then the nixl channel beside NIXL's own READ (`nixl_rows`);
  6. a table on stdout; JSON to `--json`, else `$OUT/gpu-transfer.json` when `OUT` is set.
What is missing (ucxx, a server that cannot start) becomes the rows' `unavailable` reason and a
`missing` entry with exit status 2, never a traceback; the copy reference is measured regardless.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.tools.bench import nixl_reexport
from droidmesh.shared.tools.bench.bulk_transfer import MIB, pull_rates
from droidmesh.shared.tools.bench.nixl_raw import raw_rates
from droidmesh.shared.tools.bench.tensor_proc import NIXL_RAW, TensorServer
from droidmesh.shared.tools.bench.tensor_server import one_line
from droidmesh.shared.tools.bench.ucx_proto import ucx_protocol_for, ucx_tables
from droidmesh.shared.transport import capabilities
from droidmesh.shared.transport.ucx import ucx_options

GPU_SIZES = [1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
DRY_SIZES = [64 << 10, 1 * MIB]
SERVER_START_S = 60.0  # within the 170 s transfer-check.sh gives the whole run
UCX_WHEELS = "ucxx-cu13, libucxx-cu13, libucx-cu13, rmm-cu13, librmm-cu13, rapids-logger (CUDA 13)"


def copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One `dst.copy_(src)`: CUDA events on a GPU (device time), `perf_counter` on the CPU."""
    if src.device.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_gb_s(nbytes: int, device: torch.device, repeats: int) -> float:
    """The device's own copy bandwidth for `nbytes` (bytes copied / time, one direction)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # both written: pages exist before timing
    copy_seconds(src, dst)
    return nbytes / statistics.median(copy_seconds(src, dst) for _ in range(repeats)) / 1e9


def path_name(device: torch.device, support: capabilities.CudaSupport) -> str:
    """The path the UCX rows' bytes take. A ucx sender serves every pull from its sandbox, which
    maps host memfds only, so on a GPU a device context is staged through host memory whatever
    UCX here could do with device memory (`support`: reported beside it, as `ucx_cuda`)."""
    return "host (dry run)" if device.type != "cuda" else "staged through pinned host memory"


def measure(sizes: list[int], device: torch.device, repeats: int,
            channels: tuple[str, ...] = ("ucx", "shm")) -> dict[str, Any]:
    """Steps 1-5 for `channels`: the report (rows, facts, what is missing)."""
    # asking UCX starts ucxx's own UCX: never in a run without ucx, which may load NIXL's copy
    support = capabilities.ucx_cuda_support() if "ucx" in channels else capabilities.CudaSupport(
        False, False, "not asked (no ucx rows in this run)")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": device.type != "cuda", "torch": torch.__version__, "ucx_tls": os.environ.get("UCX_TLS", ucx_options()["TLS"]),
        "ucx_cuda": {"device_memory": support.device_memory, "ipc": support.ipc, "reason": support.reason},
        "path": path_name(device, support), "missing": [],
    }
    refs = {n: copy_gb_s(n, device, repeats) for n in sizes}
    rates, lines = _ucx_rates(sizes, device, repeats, report["missing"]) if "ucx" in channels else ({}, [])
    report["shm"] = shm_rows(sizes, device, repeats, refs) if "shm" in channels else None
    if "nixl" in channels:
        report["reexport"] = reexport(device)
        report["nixl"] = nixl_rows(sizes, device, repeats, refs)
        report["missing"] += [f"nixl: {report['nixl']['missing']}"] if report["nixl"]["missing"] else []
    tables = ucx_tables(lines)  # tag-send tables by memory type
    memory = next((m for m in tables if m.startswith("cuda")), "host memory") if device.type == "cuda" else "host memory"
    report["rows"] = [{
        "bytes": n, "pull_gb_s": rates.get(n), "copy_gb_s": refs[n],
        "ratio": rates[n] / refs[n] if n in rates else None,
        "ucx_send": ucx_protocol_for(n, tables.get(memory, [])), "ucx_memory": memory if tables else None,
        "unavailable": None if n in rates else "; ".join(report["missing"]) or "not measured",
    } for n in sizes] if "ucx" in channels else []
    return report


def _ucx_rates(sizes: list[int], device: torch.device, repeats: int,
               missing: list[str]) -> tuple[dict[int, float], list[str]]:
    """Step 4 over the ucx channel: pull rates per size and everything its server printed (UCX's
    protocol tables); what is missing is appended to `missing`."""
    try:
        import ucxx  # noqa: F401  (only to say clearly when it is absent)
    except Exception as e:
        missing.append(f"ucxx ({one_line(e)}); wheels: {UCX_WHEELS}")
        return {}, []
    rates: dict[int, float] = {}
    server = TensorServer("ucx", sizes, device=device)
    try:
        server.wait_ready(SERVER_START_S)
        if server.address is None:
            missing.append(f"tensor server: {server.error}")
        else:
            rates = asyncio.run(pull_rates("ucx", server.address, sizes, repeats, device))
    except Exception as e:
        missing.append(f"pull: {one_line(e)}")
    finally:
        lines = server.stop()
    return rates, lines


PLAN_ITEMS, PLAN_ITEM_BYTES = 60, 3 * MIB // 2  # a real small model's plan: 60 layer items of 1.5 MiB
DRY_PLAN_ITEM_BYTES = 64 << 10  # ... and its items in a dry run on the CPU
FIXED_BYTES = 4 << 10


def plan_item_bytes(device: torch.device) -> int:
    return PLAN_ITEM_BYTES if device.type == "cuda" else DRY_PLAN_ITEM_BYTES


def shm_rows(sizes: list[int], device: torch.device, repeats: int, refs: dict[int, float]) -> dict[str, Any]:
    """Step 4 over the shm channel: on a GPU the sender's contexts are device allocations
    exported once (CUDA IPC) and read by offset; on the CPU, sealed memfds. Per size one item,
    then a plan (PLAN_ITEMS items in one pull), then the fixed cost (one FIXED_BYTES item)."""
    item = plan_item_bytes(device)
    out: dict[str, Any] = {"rows": [], "plan": None, "fixed_us": None, "missing": None, "exports_skipped": 0}
    skipped: list[int] = []  # per server: contexts not exported (copied through host memfds instead)
    try:
        rates = _shm_rates(sizes, device, repeats, 1, skipped)
        plan = _shm_rates([item], device, repeats, PLAN_ITEMS, skipped)[item]
        fixed = _shm_rates([FIXED_BYTES], device, max(repeats, 20), 1, skipped)[FIXED_BYTES]
    except Exception as e:
        out["missing"] = one_line(e)
        return out
    finally:
        out["exports_skipped"] = sum(skipped)
    out["rows"] = [{"bytes": n, "pull_gb_s": rates[n], "ratio": rates[n] / refs[n]} for n in sizes]
    plan_copy = copy_gb_s(item * PLAN_ITEMS, device, repeats)
    out["plan"] = {"items": PLAN_ITEMS, "item_bytes": item, "pull_gb_s": plan, "copy_gb_s": plan_copy,
                   "ratio": plan / plan_copy}
    out["fixed_us"] = FIXED_BYTES / (fixed * 1e9) * 1e6
    return out


def _shm_rates(sizes: list[int], device: torch.device, repeats: int, items: int,
               skipped: list[int]) -> dict[int, float]:
    """Pull rates from a shm tensor server; appends to `skipped` how many of its contexts it did
    not export (`device_export_skipped`: their rows measure host memfd copies, not device exports)."""
    server = TensorServer("shm", sizes, device=device, items=items)
    try:
        server.wait_ready(SERVER_START_S)
        if server.address is None:
            raise RuntimeError(f"shm tensor server: {server.error}")
        return asyncio.run(pull_rates("shm", server.address, sizes, repeats, device, items=items))
    finally:
        skipped.append(sum("device_export_skipped" in line for line in server.stop()))


def nixl_rows(sizes: list[int], device: torch.device, repeats: int, refs: dict[int, float]) -> dict[str, Any]:
    """The nixl channel beside NIXL itself (`nixl_raw`) on the same memory: per size one item, then
    a plan (PLAN_ITEMS items in one pull). On a GPU, `nixl_raw` READs device memory registered as
    VRAM into device buffers, while the channel serves a device context from a per-pull host memfd
    in its sandbox (host staging: what item 2's device path is to replace); their ratio is the gap."""
    item = plan_item_bytes(device)
    out: dict[str, Any] = {"rows": [], "plan": None, "missing": None, "raw_metadata": None}
    try:
        from droidmesh.shared.transport.nixl.agent import _bindings

        _bindings()  # a clear line when NIXL is absent (the transfer check's archive carries it)
        channel = _nixl_rates("nixl", sizes, device, repeats, 1)
        raw = _nixl_rates(NIXL_RAW, sizes, device, repeats, 1, keep=out)
        plan = {t: _nixl_rates(t, [item], device, repeats, PLAN_ITEMS)[item] for t in ("nixl", NIXL_RAW)}
    except Exception as e:
        out["missing"] = f"{one_line(e)}; wheels: nixl-cu13 (the transfer check's archive)"
        return out
    out["rows"] = [{"bytes": n, "nixl_gb_s": channel[n], "nixl_raw_gb_s": raw[n], "nixl_over_raw": channel[n] / raw[n],
                    "raw_over_copy": raw[n] / refs[n]} for n in sizes]
    out["plan"] = {"items": PLAN_ITEMS, "item_bytes": item, "nixl_gb_s": plan["nixl"], "nixl_raw_gb_s": plan[NIXL_RAW],
                   "nixl_over_raw": plan["nixl"] / plan[NIXL_RAW]}
    return out


def reexport(device: torch.device) -> dict[str, Any]:
    """Whether NIXL in a sandbox can serve memory it holds only as an import (`nixl_reexport`):
    its verdict printed at once, before the step's longer measurements (a time-out of the step
    cannot lose it), and what the receiver's screen says of the import's own metadata. Never
    raises: its failures are its verdict, not the step's."""
    result = nixl_reexport.probe(device)
    if result["metadata_b64"]:
        result["screen"] = screen_verdict(result["metadata_b64"], device.type == "cuda")
    print(result["verdict"], flush=True)
    return result


def _nixl_rates(transport: str, sizes: list[int], device: torch.device, repeats: int, items: int,
                keep: dict[str, Any] | None = None) -> dict[int, float]:
    """Pull rates of the nixl channel, or NIXL's own READ (`nixl_raw`), from a server on `device`.
    `keep`: where to record the raw server's agent metadata (base64) and memory kind: on a GPU,
    real device-memory descriptors and remote keys, which the receiver's metadata screen
    (`nixl/metadata.py`, host memory only today) must learn to check before the channel may
    read device memory."""
    server = TensorServer(transport, sizes, device=device, items=items)
    try:
        server.wait_ready(SERVER_START_S)
        if server.address is None:
            raise RuntimeError(f"{transport} tensor server: {server.error}")
        if transport == NIXL_RAW:
            if keep is not None:
                line = json.loads(server.address)
                keep["raw_metadata"] = {"memory": line.get("memory"), "device": line.get("device"),
                                        "regions": len(sizes), "metadata_b64": line["metadata"],
                                        "screen": screen_verdict(line["metadata"], line.get("memory") == "VRAM")}
            return raw_rates(server.address, sizes, items, repeats, device=device)
        return asyncio.run(pull_rates("nixl", server.address, sizes, repeats, device, items=items))
    finally:
        server.stop()


def screen_verdict(metadata_b64: str, device: bool) -> str:
    """What the receiver's metadata screen (`nixl/metadata.check_grant`, for device memory on a GPU)
    says of `nixl_raw`'s own grant-shaped metadata, as a receiver on this host would check it: the
    first comparison of the device-key screen, written from UCX's source, with keys a GPU made."""
    import base64

    from droidmesh.shared.transport.nixl import metadata
    from droidmesh.shared.transport.ucp_address import LocalView

    blob = base64.b64decode(metadata_b64)
    try:
        local = LocalView.of(metadata.own_address(blob))  # the same host's UCX: its own shapes
        _, n = metadata.check_grant(blob, local, True, None, "cuda" if device else "host", own_pid=os.getpid())
    except Exception as e:
        return f"refused: {one_line(e)}"
    return f"accepted: {n} descriptors"


def table(report: dict[str, Any]) -> str:
    head = (f"device: {report['device']}{'  (DRY RUN on CPU: not a GPU measurement)' if report['dry_run'] else ''}\n"
            f"path: {report['path']}\nUCX CUDA: {report['ucx_cuda']['reason']}\n")
    rows = [f"{'bytes':>12} {'pull GB/s':>10} {'copy GB/s':>10} {'pull/copy':>9}  UCX send protocol"]
    for r in report["rows"]:
        pull = f"{r['pull_gb_s']:10.2f}" if r["pull_gb_s"] is not None else f"{'-':>10}"
        ratio = f"{r['ratio']:9.3f}" if r["ratio"] is not None else f"{'-':>9}"
        rows.append(f"{r['bytes']:>12} {pull} {r['copy_gb_s']:10.2f} {ratio}  {r['ucx_send'] or '-'}")
    missing = "".join(f"MISSING: {m}\n" for m in report["missing"])
    if report.get("shm"):
        rows += _shm_table(report["shm"], report["dry_run"])
        missing += f"MISSING (shm): {report['shm']['missing']}\n" if report["shm"]["missing"] else ""
    if report.get("nixl"):
        rows += _nixl_table(report["nixl"])
    if report.get("reexport"):
        probe = report["reexport"]
        rows.append(probe["verdict"])
        if probe.get("screen"):
            rows.append(f"the receiver's metadata screen on the import's {probe['memory']} metadata: {probe['screen']}")
    return head + "\n".join(rows) + "\n" + missing


def _shm_table(shm: dict[str, Any], dry_run: bool) -> list[str]:
    rows = [f"shm channel ({'device exports' if not dry_run else 'sealed memfds'}):"]
    rows += [f"{r['bytes']:>12} {r['pull_gb_s']:10.2f} {'':>10} {r['ratio']:9.3f}" for r in shm["rows"]]
    if shm["plan"]:
        p = shm["plan"]
        rows.append(f"plan {p['items']} x {p['item_bytes']} bytes: {p['pull_gb_s']:.2f} GB/s, {p['ratio']:.3f} of one copy; "
                    f"fixed cost {shm['fixed_us']:.0f} us per pull")
    if shm["exports_skipped"]:
        rows.append(f"WARNING: {shm['exports_skipped']} context(s) not exported (device_export_skipped): "
                    "their pulls were copied through host memfds")
    return rows


def _nixl_table(nixl: dict[str, Any]) -> list[str]:
    rows = [f"nixl channel against NIXL's own READ (nixl_raw), same memory:\n"
            f"{'bytes':>12} {'nixl GB/s':>10} {'raw GB/s':>10} {'nixl/raw':>9} {'raw/copy':>9}"]
    rows += [f"{r['bytes']:>12} {r['nixl_gb_s']:10.2f} {r['nixl_raw_gb_s']:10.2f} {r['nixl_over_raw']:9.3f} "
             f"{r['raw_over_copy']:9.3f}" for r in nixl["rows"]]
    if nixl["plan"]:
        p = nixl["plan"]
        rows.append(f"plan {p['items']} x {p['item_bytes']} bytes: nixl {p['nixl_gb_s']:.2f} GB/s, nixl_raw "
                    f"{p['nixl_raw_gb_s']:.2f} GB/s, {p['nixl_over_raw']:.3f} of it")
    if nixl["raw_metadata"]:
        kept = nixl["raw_metadata"]
        rows.append(f"the receiver's metadata screen on nixl_raw's own {kept['memory']} metadata: {kept['screen']}")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.gpu_transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, tiny sizes (automatic without CUDA)")
    parser.add_argument("--device", default="cuda", help="the GPU (ucxx's progress thread uses device 0)")
    parser.add_argument("--sizes", help="bytes per pull, comma-separated (default: 1,16,64,256 MiB; dry run 64 KiB,1 MiB)")
    parser.add_argument("--repeats", type=int, help="timed pulls and copies per size (default 5; dry run 2)")
    parser.add_argument("--channels", default="ucx,shm",
                        help="comma-separated: ucx, shm, nixl (nixl needs NIXL: the transfer check's archive)")
    parser.add_argument("--json", type=Path, help="default: $OUT/gpu-transfer.json when OUT is set")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("CUDA is not available here: running the dry run on CPU tensors", flush=True)
    device = torch.device("cpu") if dry else torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DRY_SIZES if dry else GPU_SIZES
    channels = tuple(c for c in args.channels.split(",") if c)
    if not channels or set(channels) - {"ucx", "shm", "nixl"}:
        parser.error(f"--channels: ucx, shm and nixl, not {args.channels!r}")
    report = measure(sizes, device, args.repeats or (2 if dry else 5), channels)
    print(table(report), end="", flush=True)
    path = args.json or (Path(os.environ["OUT"]) / "gpu-transfer.json" if os.environ.get("OUT") else None)
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {path}")
    return 2 if report["missing"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
