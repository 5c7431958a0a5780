"""System tier: a real nats-server on a free port, services as separate OS processes, and the
checkpoints the zoo's ci tier really trained (built once per session)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.service.launch import Proc, start_nats
from droidmesh.shared.zoo import vocab


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


@pytest.fixture
def nats(tmp_path) -> Iterator[tuple[Proc, str]]:
    proc, url = start_nats(store_dir=str(tmp_path / "js"))
    yield proc, url
    proc.stop()


@pytest.fixture
def services() -> Iterator[list[Proc]]:
    """Processes started by a test; all stopped (SIGTERM) at teardown, newest first."""
    procs: list[Proc] = []
    yield procs
    for p in reversed(procs):
        p.stop()


def run(coro):
    return asyncio.run(coro)


async def until_indexed(client, model: ModelAdapter, context: str, tries: int = 2000, ids: list[int] | None = None) -> None:
    """Return once the broker's index answers `context` (or token `ids`) for `model` (events are
    asynchronous: a sender's prefill reply can beat its availability event to the broker)."""
    from droidmesh.shared.model import text

    ids = text.context_ids(model.tokenizer, context) if ids is None else ids
    for _ in range(tries):
        if (await client.lookup(ids, model.fingerprint.id)).holder is not None:
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
