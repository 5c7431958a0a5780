"""Counting a sandbox's death: one whose socket ends on its own is counted once, whether or not
its exit status arrives within `EXIT_S` (a busy host's child watcher can report it late); one
we ended ourselves is not. A fake process stands in for the sandbox (unit test)."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from droidmesh.shared.transport.sandbox import host
from droidmesh.shared.transport.sandbox.host import Sandbox, SandboxDied
from droidmesh.shared.wire.sandbox import SandboxReady


class LateProcess:
    """A process whose exit status comes only when `exit` says so (never, unless told)."""

    def __init__(self) -> None:
        self.pid, self.returncode, self.signals = 4242, None, []
        self._exited = asyncio.Event()

    def exit(self, status: int) -> None:
        self.returncode = status
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def _sandbox() -> tuple[Sandbox, LateProcess, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    proc = LateProcess()
    return Sandbox("ucx", proc, ours), proc, theirs  # type: ignore[arg-type]


def test_a_death_whose_status_comes_late_is_counted_once_and_the_sandbox_ended(monkeypatch):
    monkeypatch.setattr(host, "EXIT_S", 0.01)

    async def run() -> tuple[int, LateProcess, Sandbox]:
        sandbox, proc, theirs = _sandbox()
        before = host.died_total
        theirs.close()  # the sandbox's end goes (a crash), its status not yet reported
        with pytest.raises(SandboxDied, match="still running"):
            await sandbox.recv(SandboxReady, 5)
        proc.exit(-signal.SIGSEGV)  # the status arrives after the deadline
        sandbox.reap()  # the connection's end asks again: not a second death
        return host.died_total - before, proc, sandbox

    died, proc, sandbox = asyncio.run(run())
    assert died == 1
    assert proc.signals == [signal.SIGKILL] and sandbox.closed and sandbox.sock.fileno() == -1


def test_a_death_with_its_status_in_time_is_counted_and_one_we_caused_is_not(monkeypatch):
    monkeypatch.setattr(host, "EXIT_S", 5.0)

    async def run() -> tuple[int, int]:
        crashed, proc, theirs = _sandbox()
        before = host.died_total
        proc.exit(-signal.SIGSEGV)
        theirs.close()
        with pytest.raises(SandboxDied, match="SIGSEGV"):
            await crashed.recv(SandboxReady, 5)
        counted = host.died_total - before

        ended, proc, theirs = _sandbox()
        waiting = asyncio.ensure_future(ended.recv(SandboxReady, 5))
        await asyncio.sleep(0)
        ended.kill()  # ours (the receiver went): its end is no news
        proc.exit(-signal.SIGKILL)
        theirs.close()
        with pytest.raises(SandboxDied):
            await waiting
        return counted, host.died_total - before - counted

    assert asyncio.run(run()) == (1, 0)
