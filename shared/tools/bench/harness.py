"""The receiver-side probe (`shared/tools/bench/probe.py`) run as a child process, for the bench
suites that launch real processes (`pipelining`, `bandwidth`, `codec_sweep`); their meshes start
in `shared/service/localmesh.py`.

The probe is an operator's tool: it logs in as admin, which may fill a sender's store and whose
inbox senders grant pulls to. A probe run blocks to completion (up to half an hour). It trusts
the probe's stdout: the line starting with `PROBE_PREFIX` is its JSON result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from droidmesh.shared.mesh.nats_auth import MeshAccess
from droidmesh.shared.model.device import DEVICE_ENV

PROBE_MODULE = "droidmesh.shared.tools.bench.probe"
PROBE_PREFIX = "PROBE "  # the probe's one result line: this prefix, then JSON


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


def run_probe_configs(access: MeshAccess, model: str, sender: str, tokens: list[int], configs: list[dict[str, Any]],
                      repeats: int, device: str, dtype: str = "bfloat16", timeout_s: float = 1800) -> dict[str, Any]:
    """Run the configs probe (`probe.probe_configs`) against `sender`: every config timed on one
    fresh context per length in `tokens`. Raises RuntimeError with its stderr's tail if it gave
    no result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(configs, f)
    try:
        argv = [sys.executable, "-m", PROBE_MODULE, "--nats", access.url, "--model", model, "--sender", sender,
                "--tokens", ",".join(map(str, tokens)), "--repeats", str(repeats), "--configs", f.name, "--dtype", dtype]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **probe_env(access), DEVICE_ENV: device})
    finally:
        os.unlink(f.name)
    result = probe_result(out.stdout)
    if result is None:
        raise RuntimeError(f"probe failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return result


def held_bytes_per_token(checkpoint: Path, dtype: str, e_layers: int) -> int:
    """What a sender holds per context token of a checkpoint: every layer's K and V, and E at
    `e_layers` group starts, in `dtype` (a store sized for a bench's contexts)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return (kv + cfg["hidden_size"] * e_layers) * (4 if dtype == "float32" else 2)
