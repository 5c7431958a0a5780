"""The tensor server of `bench transfer` and the GPU transfer check, run as a child process.

Used by `bulk_transfer` and `gpu_transfer` from the measuring process's main thread: `TensorServer`
starts `shared.tools.bench.tensor_server` (or `nixl_raw`) and a daemon thread that reads every line it
prints; `wait_ready` blocks until its address or its refusal line (at most `SERVER_START_S`).
It trusts the child's first `BULK_ADDRESS=` / `NIXL_RAW=` / `BULK_ERROR=` line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

from droidmesh.shared.tools.bench.nixl_raw import RAW_PREFIX
from droidmesh.shared.tools.bench.tensor_server import ADDRESS_PREFIX, ERROR_PREFIX

NIXL_RAW = "nixl_raw"  # `bench transfer`'s row of NIXL itself (`nixl_raw.py`), beside the channels
SERVER_START_S = 120.0  # the server builds every tensor (256 MiB of randn) before it listens


class TensorServer:
    """`shared.tools.bench.tensor_server` (or, for `nixl_raw`, `shared.tools.bench.nixl_raw`) in a child
    process, `items` tensors per size on `device`, with `env` added to this process's environment
    (`nats_url`: pulls need grants asked for there): its address (for `nixl_raw`, its JSON line), or
    why it did not start; every stdout/stderr line it printed (UCX's protocol tables among them)."""

    def __init__(self, transport: str, sizes: list[int], *, device: str | torch.device = "cpu",
                 env: dict[str, str] | None = None, items: int = 1, nats_url: str = ""):
        env = {**os.environ, **(env or {})}
        if transport == "ucx":
            env.setdefault("UCX_PROTO_INFO", "y")
        sizes_arg = ",".join(map(str, sizes))
        if transport == NIXL_RAW:
            argv = ["-m", "droidmesh.shared.tools.bench.nixl_raw", sizes_arg, "--items", str(items), "--device", str(device)]
            self._prefix = RAW_PREFIX
        else:
            argv = ["-m", "droidmesh.shared.tools.bench.tensor_server", transport, sizes_arg, "--device", str(device),
                    "--items", str(items), *(["--nats", nats_url] if nats_url else [])]
            self._prefix = ADDRESS_PREFIX
        self.proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.address: str | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(self._prefix):
                self.address = line[len(self._prefix):].strip()
                self._ready.set()
            elif line.startswith(ERROR_PREFIX):
                self.error = line[len(ERROR_PREFIX):].strip()
                self._ready.set()
        if self.address is None and self.error is None:
            last = next((x for x in reversed(self.lines) if x.strip()), "no output")
            self.error = f"tensor server exited ({self.proc.poll()}): {last.strip()}"
        self._ready.set()

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> None:
        if not self._ready.wait(timeout_s):
            self.error = f"tensor server did not listen within {timeout_s:.0f}s"

    def stop(self) -> list[str]:
        """Terminate it; return everything it printed (complete once it has exited)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        return self.lines
