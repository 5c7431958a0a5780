"""`droidmesh serve` as the guide runs it (docs/guides/serve.md), then Ctrl-C.

The guide's runnable blocks are marked: a line `<!-- test: NAME -->` right before a fenced block.
`serve` is started as a user would, in a shell, in its own process group (with `--port 0` and
`--logs` appended: a free port, the logs kept); once it prints its `ready:` line, `health` (curl)
and `client` (the openai script) run against the port it printed, in place of the guide's 8000.
The install and zoo build steps are not marked: the real tier comes from the same build as the
other real-tier tests, and the module skips where it cannot be built. One mesh serves both tests:
the guide's requests first, then SIGINT, after which none of serve's processes may be left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "serve.md"
MARK = re.compile(r"<!-- test: ([a-z]+) -->")
GUIDE_URL = "http://127.0.0.1:8000"
READY_S = 600.0  # the receiver loads a 135M base and two adapters; a busy CI host is slow
STOP_S = 120.0  # four processes, each given up to 15 s to stop
ANSWER = re.compile(r"^  cached_tokens=(\d+) of (\d+) path=(\w+) plan=")


def guide_blocks() -> dict[str, str]:
    """NAME -> the code of the fenced block right after `<!-- test: NAME -->`, in the guide."""
    lines = GUIDE.read_text().splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = MARK.fullmatch(line.strip())
        if m:
            assert lines[i + 1].startswith("```"), f"{GUIDE.name}:{i + 2}: no fenced block after the test marker"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out[m.group(1)] = "\n".join(lines[i + 2 : end])
    return out


@dataclass
class Serving:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ready: "):
                self.url = line.split()[1].removesuffix("/v1")
                self.ready.set()
        self.ready.set()  # exited: whoever waits sees it

    def output(self) -> str:
        return "\n".join(self.lines[-60:])


def _env() -> dict[str, str]:
    """The shell of someone who ran `source .venv/bin/activate`, on one thread per process."""
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "DM_DEBUG": ""}


@pytest.fixture(scope="module")
def serving(real_tier: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The guide's `serve` block running in a shell of its own (process group and session)."""
    command = guide_blocks()["serve"].strip()
    assert command.startswith("droidmesh serve ") and "\n" not in command, command
    logs = tmp_path_factory.mktemp("serve-logs")
    proc = subprocess.Popen(["bash", "-c", f"exec {command} --port 0 --logs {logs}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    s = Serving(proc)
    threading.Thread(target=s.read, daemon=True).start()
    try:
        if not s.ready.wait(READY_S) or not s.url:
            pytest.fail(f"serve printed no ready line (exit {proc.poll()}):\n{s.output()}")
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_guide_marks_what_a_test_runs():
    blocks = guide_blocks()
    assert sorted(blocks) == ["client", "health", "serve"]
    for name in ("client", "health"):
        assert GUIDE_URL in blocks[name], f"the {name} block no longer talks to {GUIDE_URL}: update this test"


def test_the_guides_session_reuses_kv_across_adapters_then_ctrl_c_stops_it(serving: Serving, tmp_path: Path):
    """The guide's session, in its order (one test: Ctrl-C ends the serve the first steps use).
    Its health check lists the served models; its openai script's second request (to `docqa`, over
    the document `summ` read first) reuses KV: cached_tokens > 0 on a reuse path. Then SIGINT (what
    Ctrl-C sends): serve stops every process it started, says `stopped`, exits 0, and none of its
    processes (children and theirs) is left, checked with a deadline."""
    children = psutil.Process(serving.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert len(children) >= 4 and "nats-server" in names, names
    for service in ("cache_broker", "receiver", "gateway"):
        assert f"droidmesh.services.{service}" in names, names

    blocks = guide_blocks()
    health = subprocess.run(["bash", "-c", blocks["health"].replace(GUIDE_URL, serving.url)], capture_output=True,
                            text=True, env=_env(), timeout=60)
    assert health.returncode == 0, health.stderr
    assert '"status": "ok"' in health.stdout and all(f'"{m}"' in health.stdout for m in ("base", "docqa", "summ"))

    script = tmp_path / "ask.py"
    script.write_text(blocks["client"].replace(GUIDE_URL, serving.url))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\nserve:\n{serving.output()}"
    answers = [m.groups() for m in map(ANSWER.match, run.stdout.splitlines()) if m]
    assert len(answers) == 2, run.stdout
    (cached1, prompt1, path1), (cached2, prompt2, path2) = answers
    assert int(cached1) == 0 and path1 == "full_prefill", run.stdout  # nothing read before
    assert 0 < int(cached2) <= int(prompt2) and path2 in ("partial", "full_reuse"), run.stdout

    serving.proc.send_signal(signal.SIGINT)
    assert serving.proc.wait(STOP_S) == 0, serving.output()
    assert serving.lines[-1] == "stopped", serving.output()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {alive}"


def test_serve_with_api_keys_starts_and_answers_only_keyed_requests(real_tier: Path, tmp_path: Path):
    """With DM_GATEWAY_API_KEYS naming a key file, serve reaches its ready line (the keyed
    gateway's /health names no model, so serve finds them through the mesh's own discovery), the
    probe still learns no model name, a request without the key is refused (401) and one with it
    lists the served model; then Ctrl-C stops it cleanly."""
    import json
    import urllib.error
    import urllib.request

    keys_file = tmp_path / "keys.toml"
    add = subprocess.run(["droidmesh", "keys", "add", "--file", str(keys_file), "--tenant", "acme", "--models", "*"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert add.returncode == 0, add.stderr
    key = add.stdout.strip()
    proc = subprocess.Popen(["droidmesh", "serve", "real/base", "--port", "0", "--logs", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_env(), "DM_GATEWAY_API_KEYS": str(keys_file)}, start_new_session=True)
    s = Serving(proc)
    threading.Thread(target=s.read, daemon=True).start()
    try:
        assert s.ready.wait(READY_S) and s.url, f"serve printed no ready line (exit {proc.poll()}):\n{s.output()}"
        with urllib.request.urlopen(f"{s.url}/health", timeout=30) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{s.url}/v1/models", timeout=30)
        assert refused.value.code == 401
        ask = urllib.request.Request(f"{s.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(ask, timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["base"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(STOP_S) == 0, s.output()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
