"""The sender's side of its sandbox processes: starting them, talking to them, ending them.

`SandboxPool(channel)` keeps one started process as a warm spare (its transport library loaded:
NIXL ~0.3 s, ucxx ~0.7 s), so a new connection's first pull does not wait for a start; `take()`
hands the spare to a connection and starts the next. A connection ends its sandbox with
`close()` (SIGKILL: nothing in it is worth a goodbye). Every exchange with a sandbox has a
deadline; a sandbox that dies (a crash in UCX or NIXL, a kill) fails only its connection's
exchange, with `SandboxDied` naming the exit status, and is logged once with it. The sender
never loads a peer's bytes into a library of its own process for these channels.
Runs on the sender's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TypeVar

import structlog

from droidmesh.shared.errors import TransferError
from droidmesh.shared.transport import shm_io
from droidmesh.shared.transport.sandbox.child import UCX_OPTIONS_ENV
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.sandbox import SandboxFailed, SandboxReady, SandboxReport

log = structlog.get_logger("sandbox")
R = TypeVar("R", bound=schemas.Message)
START_S = 60.0  # a sandbox's start, its library loaded (a loaded CI host is slow)
ORDER_S = 30.0  # an order must be taken by the sandbox within this
# What a sandbox inherits of the sender's environment: how to run Python and the libraries, never
# a credential (a peer's reads reach the sandbox's memory, its environment included).
ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
            "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
ENV_PREFIXES = ("UCX_", "NIXL_")
_PR_SET_DUMPABLE = 4
EXIT_S = 2.0  # how long a sandbox that closed its socket is given to report its exit status
MAX_REPORT_BYTES = 1 << 20
died_total = 0  # sandboxes that ended by a signal or an error status while serving (tests, metrics)


class SandboxDied(TransferError):
    """A sandbox process ended while its connection needed it: `ended_by_us` (killed or closed by
    the sender, e.g. when its receiver went) or on its own (a crash: logged as `sandbox_died`)."""

    def __init__(self, message: str, ended_by_us: bool = False):  # a default: unpickling passes the message alone
        super().__init__(message)
        self.ended_by_us = ended_by_us


class Sandbox:
    """One started sandbox process and the sender's end of its socket."""

    def __init__(self, channel: str, proc: asyncio.subprocess.Process, sock: socket.socket):
        self.channel, self.proc, self.sock = channel, proc, sock
        self.pid = proc.pid
        self._counted = False
        self.closed = False  # ended by us: its exit is no news

    @classmethod
    async def start(cls, channel: str, env: dict[str, str]) -> Sandbox:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "droidmesh.shared.transport.sandbox", channel, str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        sandbox = cls(channel, proc, ours)
        try:
            await sandbox.recv(SandboxReady, START_S)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    async def send(self, msg: schemas.Message, fds: Sequence[int] = ()) -> None:
        if self.closed:
            raise SandboxDied(f"{self.channel} sandbox {self.pid} was ended", ended_by_us=True)
        try:
            async with asyncio.timeout(ORDER_S):
                await shm_io.send_frame(self.sock, schemas.encode(msg), list(fds))
        except TimeoutError:  # before OSError, whose subclass it is: a wedged sandbox
            self.close()
            raise TransferError(f"{self.channel} sandbox {self.pid} took no order within {ORDER_S}s") from None
        except (OSError, ValueError) as e:  # ValueError: our socket closed meanwhile (`close` from a callback)
            raise await self._died(f"{type(e).__name__}: {e}") from None

    async def recv(self, kind: type[R], deadline_s: float | None) -> R:
        """The sandbox's next report, which must be a `kind`, within `deadline_s` (None: the
        caller bounds the wait); `SandboxDied` when it ended, `TransferError` when it failed."""
        if self.closed:
            raise SandboxDied(f"{self.channel} sandbox {self.pid} was ended", ended_by_us=True)
        try:
            async with asyncio.timeout(deadline_s):
                data, _ = await shm_io.recv_frame(self.sock, MAX_REPORT_BYTES, 0)
        except TimeoutError:  # before OSError, whose subclass it is
            self.close()
            raise TransferError(f"{self.channel} sandbox {self.pid}: no {kind.__name__} within {deadline_s}s") from None
        except (EOFError, OSError, ValueError) as e:  # ValueError: our socket closed meanwhile
            raise await self._died(str(e) or type(e).__name__) from None
        report: schemas.Message = schemas.decode(data, SandboxReport)  # type: ignore[arg-type]
        if isinstance(report, SandboxFailed):
            raise TransferError(f"{self.channel} sandbox: {report.error}")
        if not isinstance(report, kind):
            raise TransferError(f"{self.channel} sandbox {self.pid}: {type(report).__name__}, expected {kind.__name__}")
        return report

    def reap(self) -> None:
        """Count and log a death that nobody waited on (the connection ended first)."""
        self._count(self.proc.returncode)

    def _count(self, status: int | None, on_its_own: bool | None = None) -> None:
        """A death we did not cause is counted and logged once: `on_its_own` (its socket ended
        before we closed it), else known from its status (not `closed` by us, not a clean exit)."""
        global died_total
        if on_its_own is None:
            on_its_own = status is not None and status != 0 and not self.closed
        if on_its_own and not self._counted:
            self._counted = True
            died_total += 1
            log.warning("sandbox_died", channel=self.channel, pid=self.pid, status=_status(status))

    async def _died(self, why: str) -> SandboxDied:
        # The socket ended, and not by our hand unless `closed` says so. Whether the exit status
        # comes within EXIT_S (a busy host's child watcher may report it later) does not decide
        # whether the death counts: one that reports none in time is ended here, and counted.
        on_its_own = not self.closed
        try:
            async with asyncio.timeout(EXIT_S):
                status = await self.proc.wait()
        except TimeoutError:
            status = None
        self._count(status, on_its_own=on_its_own and status != 0)
        self.close()
        return SandboxDied(f"{self.channel} sandbox {self.pid} ended ({_status(status)}): {why}", ended_by_us=not on_its_own)

    def kill(self) -> None:
        """End the process now (asyncio's child watcher reaps it); a wait on it then ends with
        `SandboxDied`. Safe from a callback, and more than once."""
        self.closed = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """`kill`, and close our socket (by the task that waits on it, or when nothing does)."""
        self.kill()
        self.sock.close()


class SandboxPool:
    """Sandboxes of one channel for a server's connections, one kept started as a spare."""

    def __init__(self, channel: str, ucx_options: dict[str, str] | None = None):
        self.channel = channel
        self._env = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_PREFIXES)}
        if ucx_options is not None:
            self._env[UCX_OPTIONS_ENV] = json.dumps(ucx_options)
        self._spare: asyncio.Task[Sandbox] | None = None
        self._live: set[Sandbox] = set()

    async def start(self) -> None:
        """Start the first spare and wait for it: a channel that cannot run here fails now. The
        sender's own process becomes non-dumpable: a sandbox (its user's) cannot ptrace it, read
        its memory or open its descriptors through /proc."""
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        self._spare = asyncio.ensure_future(Sandbox.start(self.channel, self._env))
        await asyncio.shield(self._spare)

    async def take(self) -> Sandbox:
        """A started sandbox for one connection (the spare, or a new one); the next spare starts."""
        spare, self._spare = self._spare, asyncio.ensure_future(Sandbox.start(self.channel, self._env))
        self._spare.add_done_callback(_quiet)
        sandbox: Sandbox | None = None
        try:
            if spare is not None:
                with contextlib.suppress(Exception):
                    sandbox = await asyncio.shield(spare)
            if sandbox is None or sandbox.proc.returncode is not None:
                if sandbox is not None:
                    sandbox.close()
                sandbox = await Sandbox.start(self.channel, self._env)
        except asyncio.CancelledError:  # the connection went meanwhile: the spare it took goes too
            if spare is not None:
                spare.add_done_callback(_close_started)
            raise
        self._live.add(sandbox)
        return sandbox

    def give_back(self, sandbox: Sandbox) -> None:
        """The connection is over: its sandbox ends, and what it mapped with it (one that had
        already died on its own is logged as `_died` would)."""
        self._live.discard(sandbox)
        sandbox.reap()
        sandbox.close()

    async def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            if spare.done() and not spare.cancelled() and spare.exception() is None:
                spare.result().close()
            else:
                spare.cancel()
                await asyncio.gather(spare, return_exceptions=True)
        for sandbox in list(self._live):
            self.give_back(sandbox)

    def live(self) -> int:
        return len(self._live)


def _close_started(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("sandbox_start_failed", error=str(task.exception())[:300])


def _status(status: int | None) -> str:
    if status is None:
        return "still running"
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    return f"exit {status}"
