"""The offline vLLM engine (`offline.py`) from another Python: a process in the vLLM environment,
driven by JSON lines, whose every output line is kept (the connector's JSON log lines among
them, prefixed by vLLM with the process that printed them).

Used by the system test and `droidmesh bench vllm`; imports nothing of vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import DroidMeshError

MODULE = "droidmesh.shared.engines.vllm.offline"
# Where `infra/vllm/install.sh` builds the vLLM environment (the same expression there).
VENV = Path(os.environ.get("DM_VLLM_VENV")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "droidmesh" / "venv-vllm")
PYTHON = VENV / "bin" / "python"


class EngineError(DroidMeshError):
    code = "engine_failed"


class OfflineEngine:
    """`python -m droidmesh.shared.engines.vllm.offline SPEC` under `python` (the vLLM
    environment's), in its own session; `stop()` ends it (closing its input, then a kill)."""

    def __init__(self, python: str | Path, spec: Mapping[str, Any], workdir: Path, env: Mapping[str, str] | None = None):
        if not Path(python).is_file():
            raise EngineError(f"no vLLM environment's python at {python}: run `bash infra/vllm/install.sh`")
        path = workdir / "engine.json"
        path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen([str(Path(python).absolute()), "-m", MODULE, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, cwd=workdir, start_new_session=True)
        self.lines: list[str] = []
        self.results: dict[str, dict[str, Any]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    self.results[str(r["id"])] = r
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until `pred()`; `EngineError` with the engine's last lines if it exits or `timeout_s` passes."""
        with self._changed:
            if not self._changed.wait_for(lambda: pred() or self.proc.poll() is not None, timeout_s) or not pred():
                tail = "\n".join(self.lines[-60:])
                raise EngineError(f"no {what} within {timeout_s:g}s (engine exit {self.proc.poll()}):\n{tail}")

    def ready(self, timeout_s: float) -> None:
        self.wait(lambda: "READY" in self.lines, timeout_s, "READY line")

    def ask(self, rid: str, prompt: list[int], *, max_tokens: int, mode: str = "auto", lora: str | None = None,
            timeout_s: float = 300.0) -> dict[str, Any]:
        """One greedy request: {"id", "request_id", "tokens", "seconds"}."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "prompt": prompt, "max_tokens": max_tokens, "lora": lora,
                                          "mode": mode}) + "\n")
        self.proc.stdin.flush()
        self.wait(lambda: rid in self.results, timeout_s, f"answer to {rid}")
        return self.results[rid]

    def events(self, event: str, request_id: str) -> list[dict[str, Any]]:
        """The connector's `event` lines of one vLLM request (the engine suffixes its ids)."""
        out = []
        for line in list(self.lines):
            start = line.find("{")
            if start < 0 or f'"{event}"' not in line:
                continue
            try:
                rec = json.loads(line[start:])
            except ValueError:
                continue
            rid = str(rec.get("request_id", ""))
            if rec.get("event") == event and (rid == request_id or rid.startswith(f"{request_id}-")):
                out.append(rec)
        return out

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
