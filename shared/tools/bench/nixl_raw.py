"""`bench transfer`'s `nixl_raw` row: NIXL itself, used as its own documentation shows, between two
processes — the reference the `nixl` channel is measured against.

Server (`python -m droidmesh.shared.tools.bench.nixl_raw SIZE[,SIZE...] --items N [--device D]`, a
child process): per size N bf16 tensors of that many bytes on D (host memory, or a GPU's,
registered as NIXL's VRAM), all registered once with an agent configured as the channel's sender
is (`nixl.agent.Agent`: UCX backend, a progress thread that sleeps on UCX events; the remote side
of the first READ's wire-up needs it); it prints one line `NIXL_RAW=<json>` (its agent metadata,
base64, where its tensors lie, and each context's regions) and runs until SIGTERM. Client
(`raw_rates`, this process): NIXL's own Python API (`nixl_agent`, no progress thread: the API
hard-codes its delay to 0, which would spin a core; this thread polls instead) loads that
metadata, registers its landing buffers once (on the device asked for), prepares both descriptor
lists once and one READ of all N items per size, then times re-posts of that READ polled to
completion. Nothing per pull but the post and the polls: what the library costs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import torch

from droidmesh.shared.tools.bench.tensor_server import ERROR_PREFIX, one_line, tensors_for

RAW_PREFIX = "NIXL_RAW="


def api_agent(role: str) -> Any:
    import importlib
    import importlib.util

    # the CUDA 12 / 13 wheels, or a source build (as the channel's own agent finds them)
    name = next((m for m in ("nixl_cu12", "nixl_cu13") if importlib.util.find_spec(m)), "nixl")
    api = importlib.import_module(f"{name}._api")
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    return nixl_agent(f"droidmesh-raw-{role}-{uuid.uuid4().hex[:8]}", nixl_agent_config(enable_prog_thread=False))


def serve(sizes: list[int], items: int, device: str = "cpu") -> int:
    from droidmesh.shared.transport.nixl.agent import Agent

    try:
        dev = torch.device(device)
        memory, index = ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)
        tensors = tensors_for(sizes, dev, items)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # filled before any peer reads them
        agent = Agent("raw-sender")  # NIXL's bindings, with a progress thread that sleeps on UCX events
        asyncio.run(agent.start())
        regions = [(t.data_ptr(), t.numel() * t.element_size()) for held in tensors.values() for t in held]
        registered = agent.submit(agent.register, regions, memory, index).result()
        line = {"metadata": base64.b64encode(agent.submit(agent.metadata, regions, True, memory, index).result()).decode(),
                "memory": memory, "device": index,
                "contexts": {cid: [[t.data_ptr(), t.numel() * t.element_size()] for t in held]
                             for cid, held in tensors.items()}}
    except Exception as e:
        print(ERROR_PREFIX + one_line(e), flush=True)
        return 1
    print(RAW_PREFIX + json.dumps(line), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    agent.submit(agent.deregister, registered).result()
    agent.close()
    return 0


def raw_rates(line: str, sizes: list[int], items: int, repeats: int, read: int | None = None,
              device: str | torch.device = "cpu") -> dict[int, float]:
    """GB/s per size of one READ of the first `read` (default: all `items`) items of that size's
    context into buffers on `device` (median of `repeats` after one warm-up): NIXL's own API
    registers CUDA tensors as device memory, and the server says where its own lie."""
    read = read or items
    info = json.loads(line)
    memory, index = info.get("memory", "DRAM"), int(info.get("device", 0))
    agent = api_agent("receiver")
    peer = agent.add_remote_agent(base64.b64decode(info["metadata"]))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    rates = {}
    for n in sizes:
        into = [torch.zeros(n // 2, dtype=torch.bfloat16, device=device) for _ in range(read)]  # written: pages exist
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before any READ lands in them
        remote = [(a, b, index) for a, b in info["contexts"][str(n)][:read]]
        times = timed_reads(agent, peer, into, remote, memory, repeats)
        rates[n] = n * read / statistics.median(times[1:]) / 1e9
    agent.remove_remote_agent(peer)
    return rates


def timed_reads(agent: Any, peer: str, into: list[torch.Tensor], remote: list[tuple[int, int, int]], memory: str,
                repeats: int) -> list[float]:
    """Seconds of each of `repeats` + 1 READs (the first a warm-up) of `remote` regions (address,
    bytes, device) of `peer` into `into`, registered for them: both descriptor lists and the READ
    prepared once, then re-posted and polled to completion. `into` keeps the last READ's bytes."""
    registered = agent.register_memory(into)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", into)
    far = agent.prep_xfer_dlist(peer, remote, memory)
    handle = agent.make_prepped_xfer("READ", local, list(range(len(into))), far, list(range(len(remote))))
    try:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ failed ({state})")
        return times
    finally:
        agent.release_xfer_handle(handle)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(far)
        agent.deregister_memory(registered)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.nixl_raw")
    parser.add_argument("sizes")
    parser.add_argument("--items", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the tensors lie: cpu (DRAM) or cuda[:N] (VRAM)")
    args = parser.parse_args(argv)
    return serve([int(s) for s in args.sizes.split(",")], max(1, args.items), args.device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
