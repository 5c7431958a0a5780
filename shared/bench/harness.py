"""What the bench suites that launch real processes share: the environment of a launched model
process, a mesh (nats-server first, then whatever services a suite adds) that is torn down
whatever happens, and the receiver-side probe (`shared/bench/probe.py`) run as a child process.

The mesh runs as deployments do: nats-server under the suite's roster of per-role users with
fresh passwords (`start_secure_nats`); a suite starts each service with `access.env_for` its own
user. The probe is an operator's tool: it logs in as admin, which may fill a sender's store and
whose inbox senders grant pulls to.

Called by the pipeline, bandwidth, control, load and codecs suites (`pipelining`, `bandwidth`,
`control_plane`, `load`, `codec_sweep`). Everything here blocks: starting a service waits for its
`ready` event, a probe runs to completion (up to half an hour). It trusts the probe's stdout: the
line starting with `PROBE_PREFIX` is its JSON result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster
from droidmesh.shared.model.device import DEVICE_ENV
from droidmesh.shared.service.launch import Proc, start_secure_nats

THREADS = {"OMP_NUM_THREADS": "1"}
PROBE_MODULE = "droidmesh.shared.bench.probe"
PROBE_PREFIX = "PROBE "  # the probe's one result line: this prefix, then JSON


def launched_env(device: str) -> dict[str, str]:
    """Environment of a launched model process: one torch thread, models on `device`. The
    services keep `dtype` bfloat16 given explicitly, on any device."""
    return {**THREADS, DEVICE_ENV: device}


@contextmanager
def mesh(roster: Roster, host: str = "127.0.0.1", wrap: list[str] | None = None
         ) -> Iterator[tuple[MeshAccess, list[Proc]]]:
    """A nats-server on `host` (run under `wrap`, e.g. `ip netns exec NS`) for `roster`'s users:
    yields (access, procs). A suite appends the services it starts to `procs` (and may remove one
    it stopped itself); on the way out every process left in it is stopped, last started first."""
    procs: list[Proc] = []
    try:
        nats, access = start_secure_nats(roster, host=host, wrap=wrap)
        procs.append(nats)
        yield access, procs
    finally:
        for p in reversed(procs):
            p.stop()


def probe_result(stdout: str) -> dict[str, Any] | None:
    """The probe's JSON result in its `stdout`, or None if it printed none."""
    line = next((l for l in stdout.splitlines() if l.startswith(PROBE_PREFIX)), None)
    return None if line is None else json.loads(line[len(PROBE_PREFIX):])


def probe_env(access: MeshAccess) -> dict[str, str]:
    """The probe's login (see the module docstring)."""
    return access.env_for("admin")


def run_probe(access: MeshAccess, model: str, sender: str, tokens: int, group: tuple[int, int], repeats: int,
              device: str, wrap: list[str] | None = None, env: dict[str, str] | None = None,
              lines: list[str] | None = None) -> dict[str, Any]:
    """Run the probe for recompute `group` against `sender` (under `wrap`, with `env` added);
    append its stdout to `lines`. Raises RuntimeError with its stderr's tail if it gave no result."""
    argv = [*(wrap or []), sys.executable, "-m", PROBE_MODULE, "--nats", access.url, "--model", model,
            "--sender", sender, "--tokens", str(tokens), "--group", f"{group[0]},{group[1]}", "--repeats", str(repeats)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **(env or {}), **probe_env(access), DEVICE_ENV: device})
    if lines is not None:
        lines.extend(out.stdout.splitlines())
    result = probe_result(out.stdout)
    if result is None:
        raise RuntimeError(f"probe failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return result
