"""System tier: a real nats-server on a free port and services as separate OS processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from shared.launch import Proc, start_nats


@pytest.fixture
def nats(tmp_path) -> Iterator[tuple[Proc, str]]:  # type: ignore[no-untyped-def]
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


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)
