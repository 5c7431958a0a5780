"""The tensor server of `bench transfer` and the GPU transfer check, run as a child process.

Used by `bulk_transfer` and `gpu_transfer` from the measuring process's main thread: `TensorServer`
starts `shared.tools.bench.tensor_server` (or `nixl_raw`) as a `launch.Proc` (its lines kept by the
launcher's reader; it dies with this process); `wait_ready` blocks until its address or its refusal
line (at most `SERVER_START_S`). It trusts the child's first `BULK_ADDRESS=` / `NIXL_RAW=` /
`BULK_ERROR=` line.
"""

from __future__ import annotations

import os
import sys

import torch

from droidmesh.shared.service.launch import Proc
from droidmesh.shared.tools.bench.nixl_raw import RAW_PREFIX
from droidmesh.shared.tools.bench.tensor_server import ADDRESS_PREFIX, ERROR_PREFIX

NIXL_RAW = "nixl_raw"  # `bench transfer`'s row of NIXL itself (`nixl_raw.py`), beside the channels
SERVER_START_S = 120.0  # the server builds every tensor (256 MiB of randn) before it listens
STOP_S = 10.0  # SIGTERM, then SIGKILL


class TensorServer:
    """`shared.tools.bench.tensor_server` (or, for `nixl_raw`, `shared.tools.bench.nixl_raw`) in a child
    process, `items` tensors per size on `device`, with `env` added to this process's environment
    (`nats_url`: pulls need grants asked for there): its address (for `nixl_raw`, its JSON line), or
    why it did not start; every stdout/stderr line it printed (UCX's protocol tables among them)."""

    def __init__(self, transport: str, sizes: list[int], *, device: str | torch.device = "cpu",
                 env: dict[str, str] | None = None, items: int = 1, nats_url: str = ""):
        env = dict(env or {})
        if transport == "ucx" and "UCX_PROTO_INFO" not in os.environ:  # the caller's own setting wins
            env.setdefault("UCX_PROTO_INFO", "y")
        sizes_arg = ",".join(map(str, sizes))
        if transport == NIXL_RAW:
            argv = ["-m", "droidmesh.shared.tools.bench.nixl_raw", sizes_arg, "--items", str(items), "--device", str(device)]
            self._prefix = RAW_PREFIX
        else:
            argv = ["-m", "droidmesh.shared.tools.bench.tensor_server", transport, sizes_arg, "--device", str(device),
                    "--items", str(items), *(["--nats", nats_url] if nats_url else [])]
            self._prefix = ADDRESS_PREFIX
        self.proc = Proc(f"tensor-server-{transport}", [sys.executable, *argv], env=env)
        self.address: str | None = None
        self.error: str | None = None

    @property
    def lines(self) -> list[str]:
        return self.proc.lines

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> None:
        """Its address, or why it has none (`error`): its refusal line, its exit, or the deadline."""
        try:
            line = self.proc.wait_for(lambda x: x.startswith((self._prefix, ERROR_PREFIX)), timeout_s, "address")
        except TimeoutError:
            self.error = f"tensor server did not listen within {timeout_s:.0f}s"
            return
        except RuntimeError:  # it exited first
            last = next((x for x in reversed(self.proc.lines) if x.strip()), "no output")
            self.error = f"tensor server exited ({self.proc.popen.poll()}): {last.strip()}"
            return
        if line.startswith(self._prefix):
            self.address = line[len(self._prefix):].strip()
        else:
            self.error = line[len(ERROR_PREFIX):].strip()

    def stop(self) -> list[str]:
        """Terminate it; return everything it printed (complete once it has exited)."""
        self.proc.stop(STOP_S)
        return self.proc.lines
