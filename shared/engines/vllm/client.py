"""A vLLM engine with the DroidMesh connector, from another Python: a process in the vLLM
environment whose every output line is kept (the connector's JSON log lines among them, prefixed
by vLLM with the process that printed them). Two forms, one interface (`Engine`):

  - `ServedEngine`: `vllm serve`, vLLM's own OpenAI server, as users run it (`serve_argv` is the
    command the guide shows); requests go over HTTP (`/v1/completions`, token ids in and out);
  - `OfflineEngine`: the offline engine of `offline.py`, driven by JSON lines.

Used by the system test and `droidmesh bench vllm`; imports nothing of vLLM.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

from droidmesh.shared.errors import DroidMeshError

MODULE = "droidmesh.shared.engines.vllm.offline"
CLI = "droidmesh.shared.engines.vllm.cli"  # `vllm`'s own command line, in the CPU build's environment too
CONNECTOR = "DroidMeshConnector"
CONNECTOR_MODULE = "droidmesh.shared.engines.vllm.connector"
# Where `infra/vllm/install.sh` builds the vLLM environment (the same expression there).
VENV = Path(os.environ.get("DM_VLLM_VENV")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "droidmesh" / "venv-vllm")
PYTHON = VENV / "bin" / "python"
MARK = "\x00droidmesh-drained"  # a line of our own in an engine's output pipe (`EngineProcess.drained`)


class EngineError(DroidMeshError):
    code = "engine_failed"


class Engine(Protocol):
    def ask(self, rid: str, prompt: list[int], *, max_tokens: int, mode: str = "auto", lora: str | None = None,
            timeout_s: float = 300.0) -> dict[str, Any]: ...

    def events(self, event: str, request_id: str) -> list[dict[str, Any]]: ...


def kv_transfer_config(connector: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for the DroidMesh connector with `connector`'s settings."""
    role = "kv_both" if connector.get("hold") else "kv_consumer"  # holding makes it a sender too
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": dict(connector)}


# vLLM's CPU backend binds the worker's threads to all cores but the ones it reserves: one per rank
# for the scheduler, and one more per rank when any KV connector is configured (room for NIXL's
# prefill/decode transfers, `vllm/utils/ompmultiprocessing.py`). The DroidMesh connector loads
# inside the step, on the worker's own threads, so that core would idle; and where it leaves no
# core to bind (2 cores), vLLM reserves none, the worker's threads then sharing the scheduler's
# busy-polling core: a miss took ~5 % longer than vLLM alone (`docs/performance.md`). An engine
# started here reserves what vLLM alone does, unless the caller set it; `hold` keeps vLLM's
# choice (its holder computes E beside the engine).
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_env(spec: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` plus the CPU reservation vLLM makes without a connector (one core per rank; engines
    started here are one rank), for a spec whose connector does not hold."""
    out = dict(env or {})
    connector = spec.get("connector")
    if connector is not None and not connector.get("hold") and RESERVED_CPUS not in {**os.environ, **out}:
        out[RESERVED_CPUS] = "1"
    return out


def serve_argv(python: str | Path, spec: Mapping[str, Any], port: int) -> list[str]:
    """`vllm serve` of an engine spec (`offline.py`'s ENGINE.json fields, and "name": the served
    name of its base model) on 127.0.0.1:`port`."""
    argv = [str(python), "-m", CLI, "serve", str(spec["model"]),
            "--served-model-name", str(spec.get("name", "base")), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", str(spec.get("dtype", "float32")), "--max-model-len", str(spec.get("max_model_len", 4096)),
            "--max-num-seqs", str(spec.get("max_num_seqs", 4)), "--no-enable-prefix-caching", "--enforce-eager",
            "--seed", "0", "--disable-uvicorn-access-log"]
    loras = spec.get("loras") or {}
    if loras:
        argv += ["--enable-lora", "--max-lora-rank", str(spec.get("max_lora_rank", 16)), "--max-loras",
                 str(len(loras)), "--lora-modules", *(f"{n}={p}" for n, p in sorted(loras.items()))]
    if spec.get("connector") is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec["connector"]))]
    return argv


class EngineProcess:
    """An engine process in its own session, its output lines kept; `stop()` ends it."""

    def __init__(self, argv: list[str], workdir: Path, env: Mapping[str, str] | None, stdin: bool):
        if not Path(argv[0]).is_file():
            raise EngineError(f"no vLLM environment's python at {argv[0]}: run `bash infra/vllm/install.sh`")
        # The engine's output pipe is ours to write as well: `drained` puts a mark behind the
        # lines already in it (a pipe keeps its writers' order; an HTTP reply does not wait for
        # the log lines of its request to be read).
        out, self._mark_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                         stdout=self._mark_fd, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, **(env or {})}, cwd=workdir, start_new_session=True)
        except BaseException:
            os.close(out)
            os.close(self._mark_fd)
            raise
        self.lines: list[str] = []
        self._marked = -1  # the last of our marks the reader has met (they go out numbered 0, 1, ...)
        self._eof = False
        self._counter = itertools.count()
        self._changed = threading.Condition()
        self._mark_lock = threading.Lock()
        threading.Thread(target=self._read, args=(open(out, encoding="utf-8", errors="replace"),), daemon=True).start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _read(self, stream: TextIO) -> None:
        with stream:
            for line in stream:
                with self._changed:
                    if line.startswith(MARK):
                        self._marked = int(line[len(MARK):])
                    else:
                        self.lines.append(line.rstrip("\n"))
                        self.on_line(line)
                    self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _reap(self) -> None:
        """Closes our end of the pipe once the engine has exited, so that the reader meets its end."""
        self.proc.wait()
        with self._mark_lock:
            os.close(self._mark_fd)
            self._mark_fd = -1
        with self._changed:
            self._changed.notify_all()

    def drained(self, timeout_s: float = 30.0) -> None:
        """Until every line the engine wrote before this call is in `lines`; `EngineError` past
        `timeout_s`. (Once the engine has exited, until its output ends.)"""
        with self._mark_lock:
            mark = next(self._counter)
            if self._mark_fd >= 0:
                os.write(self._mark_fd, f"{MARK}{mark}\n".encode())
        with self._changed:
            if not self._changed.wait_for(lambda: self._marked >= mark or self._eof, timeout_s):
                raise EngineError(f"the engine's output was not read within {timeout_s:g}s")

    def on_line(self, line: str) -> None:
        return

    def wait(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until `pred()`; `EngineError` with the engine's last lines if it exits or `timeout_s` passes."""
        with self._changed:
            if not self._changed.wait_for(lambda: pred() or self.proc.poll() is not None, timeout_s) or not pred():
                tail = "\n".join(self.lines[-60:])
                raise EngineError(f"no {what} within {timeout_s:g}s (engine exit {self.proc.poll()}):\n{tail}")

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
        try:
            self.close_gently()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close_gently(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)


class OfflineEngine(EngineProcess):
    """`python -m droidmesh.shared.engines.vllm.offline SPEC` under `python` (the vLLM
    environment's); `stop()` closes its input (then kills it)."""

    def __init__(self, python: str | Path, spec: Mapping[str, Any], workdir: Path, env: Mapping[str, str] | None = None):
        # a file of its own: the process reads it after its imports, by when another engine
        # started beside it in the same directory would have replaced a shared one
        fd, name = tempfile.mkstemp(prefix="engine-", suffix=".json", dir=workdir)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        path = Path(name)
        self.results: dict[str, dict[str, Any]] = {}
        super().__init__([str(Path(python).absolute()), "-m", MODULE, str(path)], workdir, cpu_env(spec, env), stdin=True)

    def on_line(self, line: str) -> None:
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            self.results[str(r["id"])] = r

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

    def close_gently(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()


class ServedEngine(EngineProcess):
    """`vllm serve` (`serve_argv`) under `python`: vLLM's OpenAI server, asked over HTTP."""

    def __init__(self, python: str | Path, spec: Mapping[str, Any], workdir: Path, port: int,
                 env: Mapping[str, str] | None = None, args: list[str] | None = None):
        """`args`: `vllm` CLI arguments to run instead of `serve_argv(spec)` (e.g. a deployment's
        own command); they must serve on 127.0.0.1:`port`, the name `spec["name"]`."""
        self.url = f"http://127.0.0.1:{port}"
        self.base_name = str(spec.get("name", "base"))
        argv = serve_argv(Path(python).absolute(), spec, port) if args is None else \
            [str(Path(python).absolute()), "-m", CLI, *args]
        super().__init__(argv, workdir, cpu_env(spec, env), stdin=False)

    def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.wait(lambda: False, 0, f"healthy server at {self.url}")
            time.sleep(1.0)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def ask(self, rid: str, prompt: list[int], *, max_tokens: int, mode: str = "auto", lora: str | None = None,
            timeout_s: float = 300.0) -> dict[str, Any]:
        """One greedy completion of token ids, its id `rid` (vLLM's request id is `cmpl-<rid>-0`
        and a suffix): {"id", "request_id", "tokens", "seconds"}, seconds the whole HTTP call."""
        body = {"model": lora or self.base_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"droidmesh_mode": mode}}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": rid})
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"vLLM answered {e.code} to {rid}: {e.read()[:300]!r}") from e
        seconds = time.perf_counter() - began
        self.drained()  # the connector's lines of this request were written before vLLM replied
        return {"id": rid, "request_id": f"cmpl-{rid}-0", "tokens": list(out["choices"][0]["token_ids"]),
                "seconds": seconds}
