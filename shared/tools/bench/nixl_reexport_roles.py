"""The three processes of the re-export probe (`nixl_reexport.probe`), one role each:
`python -m droidmesh.shared.tools.bench.nixl_reexport_roles ROLE --device D --bytes N --repeats R`.

Each sets up what it can at once (torch, CUDA, its NIXL agent: the three start together), then
reads its input, the answer of the role before it, as one line on stdin, and prints its own as
`REEXPORT=<json>` (or `{"error": ...}`); the owner and the sandbox then hold what they made until
their stdin closes (the probe's stop, or its death: nothing outlives the probe).
  owner    `pattern` bytes placed as a sender places a context: on a GPU one device allocation
           of its own, exported by CUDA IPC (`cuda_ipc.place`: `_share_cuda_`'s handle); on the CPU
           a sealed memfd (`memfd.sealed_memfd`), named by its /proc path;
  sandbox  a buffer of its own allocation with the same bytes, registered with its NIXL agent
           (`nixl.agent.Agent`; VRAM on a GPU, DRAM on the CPU) and its metadata taken (with the
           agent's connection info); then the owner's import opened (`cuda_ipc.open_export`:
           cudaIpcOpenMemHandle; on the CPU the memfd mapped read-only, as the nixl sandbox maps a
           grant's) and registered the same way: its metadata (and, for the receiver's screen, the
           same with connection info, as a first grant carries it), or the stage that failed
           (`import`: the probe's own set-up; `register` or `metadata`: NIXL's, during which UCX's
           cuda_ipc asks the driver for an IPC handle to the import when it packs its remote key);
  reader   NIXL's own API (`nixl_raw`'s client) loads each buffer's metadata and READs it into one
           of its own (`nixl_raw.timed_reads`: a warm-up, then R timed), checks the bytes, and
           prints a line per buffer, each after a `REEXPORT_TARGET=` mark: with UCX_PROTO_INFO=y
           the protocol tables its UCX prints between marks name each READ's transport.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import json
import mmap
import os
import statistics
import sys
from typing import Any

import numpy as np
import torch

from droidmesh.shared.tools.bench.tensor_server import one_line

PREFIX = "REEXPORT="
MARK = "REEXPORT_TARGET="
TARGETS = ("own", "import")
ROLES = ("owner", "sandbox", "reader")


def pattern(nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [nbytes], byte i = i % 251: a prime period, so bytes read from a wrong offset differ."""
    return (torch.arange(nbytes, device=device) % 251).to(torch.uint8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def owner(device: torch.device, nbytes: int) -> tuple[dict[str, Any], Any]:
    """The owner: (the import's description, what must live while it is imported)."""
    data = pattern(nbytes, device)
    if device.type == "cuda":
        from droidmesh.shared.transport import cuda_ipc

        view = cuda_ipc.place([data])[0]
        found = cuda_ipc.exported(view)
        if found is None:
            raise RuntimeError("the allocation was not exported (device_export_skipped, logged above)")
        export, offset = found
        return {"handle": _b64(export.handle), "size": export.nbytes, "offset": offset}, view
    from droidmesh.shared.transport import memfd

    fd = memfd.sealed_memfd(nbytes, [(0, data)])
    return {"path": f"/proc/{os.getpid()}/fd/{fd}", "size": nbytes, "offset": 0}, fd


def _open_import(device: torch.device, given: dict[str, Any], nbytes: int, kept: list[Any]) -> int:
    """The address of the owner's bytes as this process imports them (kept open in `kept`)."""
    if given["offset"] + nbytes > given["size"]:
        raise ValueError(f"{nbytes} bytes at {given['offset']} do not fit an import of {given['size']}")
    if device.type == "cuda":
        from droidmesh.shared.transport import cuda_ipc
        from droidmesh.shared.transport.exports import Export

        mapping = cuda_ipc.open_export(Export(1, given["size"], base64.b64decode(given["handle"])))
        kept.append(mapping)
        assert mapping.tensor is not None
        return int(mapping.tensor.data_ptr()) + given["offset"]
    fd = os.open(given["path"], os.O_RDONLY)
    try:  # populated at once, read-only: as the nixl sandbox maps a grant's memfds
        mm = mmap.mmap(fd, given["size"], flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = np.frombuffer(mm, dtype=np.uint8)  # [size]
    kept += [mm, view]
    return int(view.ctypes.data) + given["offset"]


def _given() -> dict[str, Any] | None:
    """The line the probe writes once the role before this one has answered; None when it closes
    stdin instead (that role failed, or the probe is over). Each role sets up what it can first,
    so the three start (torch, CUDA, NIXL) at once."""
    line = sys.stdin.readline().strip()
    return json.loads(line) if line else None


def sandbox(device: torch.device, nbytes: int) -> tuple[dict[str, Any] | None, Any, list[Any]]:
    """The sandbox: (what the reader needs, or None without an owner's answer; the agent; what must
    live while it serves)."""
    from droidmesh.shared.transport.nixl.agent import Agent

    memory, index = ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)
    own = pattern(nbytes, device)  # the baseline: memory this process allocated, as nixl_raw's server holds
    kept: list[Any] = [own]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # written before any READ
    agent = Agent("reexport-sandbox")
    asyncio.run(agent.start())
    served: dict[str, Any] = {"memory": memory, "device": index}
    region = [(own.data_ptr(), nbytes)]
    agent.submit(agent.register, region, memory, index).result()
    served["own"] = {"addr": own.data_ptr(), "metadata": _b64(agent.submit(agent.metadata, region, True, memory, index).result())}
    if (given := _given()) is None:
        return None, agent, kept
    stage = "import"  # a failure before NIXL is asked leaves the question untested
    try:
        region = [(_open_import(device, given, nbytes, kept), nbytes)]
        stage = "register"
        agent.submit(agent.register, region, memory, index).result()
        stage = "metadata"
        metadata = agent.submit(agent.metadata, region, False, memory, index).result()
        grant = agent.submit(agent.metadata, region, True, memory, index).result()  # as a first grant: for the screen
        served["import"] = {"addr": region[0][0], "metadata": _b64(metadata), "grant": _b64(grant)}
    except Exception as e:
        served["import"] = {"stage": stage, "error": one_line(e)}
    return served, agent, kept


def reader(device: torch.device, nbytes: int, repeats: int) -> None:
    """The reader: one `REEXPORT=` line per buffer the sandbox registered, each after its mark."""
    from droidmesh.shared.tools.bench.nixl_raw import api_agent

    agent = api_agent("reexport-receiver")
    want = pattern(nbytes, device)
    if (served := _given()) is None:
        return
    for target in TARGETS:
        if "metadata" not in served[target]:
            continue
        print(MARK + target, flush=True)  # the tables UCX prints for this READ follow (`_c_stdout_by_line`)
        print(PREFIX + json.dumps(_read(agent, target, served, device, nbytes, repeats, want)), flush=True)


def _read(agent: Any, target: str, served: dict[str, Any], device: torch.device, nbytes: int, repeats: int,
          want: torch.Tensor) -> dict[str, Any]:
    from droidmesh.shared.tools.bench.nixl_raw import timed_reads

    try:
        peer = agent.add_remote_agent(base64.b64decode(served[target]["metadata"]))
        peer = peer.decode() if isinstance(peer, bytes) else peer
        into = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before the READ lands
        remote = [(served[target]["addr"], nbytes, served["device"])]
        times = timed_reads(agent, peer, [into], remote, served["memory"], repeats)
        return {"target": target, "gb_s": nbytes / statistics.median(times[1:]) / 1e9, "match": bool(torch.equal(into, want))}
    except Exception as e:
        return {"target": target, "error": one_line(e)}


def _c_stdout_by_line() -> None:
    """C's stdout (UCX's logs and protocol tables) written at each line's end, as this process's
    own lines are: on a pipe it goes out in blocks, which end mid-line and land before our lines
    printed after, not where UCX wrote them."""
    try:
        libc = ctypes.CDLL(None)
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 1, 0)  # _IOLBF, before anything is written
    except (AttributeError, OSError, ValueError):
        pass  # not glibc: the probe finds its lines anywhere in a line all the same


def _role(args: argparse.Namespace) -> int:
    """A child's life: its `REEXPORT=` answer, then (owner, sandbox) holding what it made until its
    stdin closes (the probe's stop, or its death: nothing outlives the probe)."""
    device, role, agent = torch.device(args.device), args.role, None
    answer: dict[str, Any] | None
    _c_stdout_by_line()
    try:
        if role == "reader":
            reader(device, args.bytes, args.repeats)
            return 0
        if role == "owner":
            answer, held = owner(device, args.bytes)
        else:
            answer, agent, held = sandbox(device, args.bytes)
    except Exception as e:
        print(PREFIX + json.dumps({"error": one_line(e)}), flush=True)
        return 1
    if answer is not None:
        print(PREFIX + json.dumps(answer), flush=True)
        sys.stdin.read()
    if agent is not None:
        agent.close()
    del held
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.nixl_reexport_roles")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--device", required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    return _role(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
