"""The service runtime: what every DroidMesh service process is, apart from its handlers.

`ServiceRuntime` is the base of the four services (an async context manager). Entering it:
  1. starts the health server first: /livez answers before anything slow happens, /readyz stays
     503 until step 2 is done (so a slow model load is not restart-looped, and no traffic is
     routed to a copy that is still loading)
  2. awaits the subclass's `start()`: load the model (`run_torch`), `connect()` the bus,
     subscribe the handlers, `tasks.supervise(...)` the background loops
Leaving it (or a failed / cancelled start) cleans up in one order: not ready -> background tasks
cancelled -> `withdraw()` (the bus is still open) -> the bus drained (requests already taken are
answered) -> `release()` (transports those requests used) -> the torch worker -> health.

/readyz is `ready`: started, not stopping, and every supervised loop running. A loop that crashes
(today's heart-beat or expiry loop losing its connection, say) is logged and restarted with
backoff, and the service reports not-ready from the crash until the loop runs again.

`run_until_signalled` installs the SIGTERM / SIGINT handlers before anything connects or loads,
so a service stuck connecting to an unreachable NATS stops at once. `main` is the body of every
`python -m droidmesh.services.<name>`. This module imports neither torch nor the models: the broker uses it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar
from urllib.parse import urlsplit

import structlog

from droidmesh.shared import __version__
from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.mesh.bus import Bus, NatsBus
from droidmesh.shared.service import settings
from droidmesh.shared.service.log import configure_logging
from droidmesh.shared.service.metrics import HealthServer, Metrics

if TYPE_CHECKING:
    from droidmesh.shared.model.adapter import ModelAdapter

log = structlog.get_logger("runtime")
C = TypeVar("C", bound=settings.BusSettings)


class Supervisor:
    """A service's background tasks; every method is called on the service's event loop.

    - `supervise(name, loop)`  `loop()` makes the coroutine of a loop meant to run until the
                               service stops. If it raises (or returns), that is logged, the loop
                               is started again after a backoff (doubling from `backoff_s` up to
                               `max_backoff_s`, back to `backoff_s` after a run that long), and
                               `healthy` is false from the fault until the loop runs again.
    - `spawn(coro, name)`      a one-shot task (an endpoint warm-up); a failure is logged only.
    - `healthy`                no supervised loop is down.
    - `close()`                cancel every task and wait for each to finish, for at most
                               `stop_s`: a task that outlives it (a library that swallowed its
                               cancellation) is logged and left, so a stop never hangs.
    """

    def __init__(self, backoff_s: float = 0.5, max_backoff_s: float = 30.0, stop_s: float = 5.0):
        self._backoff_s, self._max_backoff_s, self._stop_s = backoff_s, max_backoff_s, stop_s
        self._tasks: set[asyncio.Task] = set()
        self._down: set[str] = set()  # supervised loops between a fault and their restart

    @property
    def healthy(self) -> bool:
        return not self._down

    def supervise(self, name: str, loop: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.spawn(self._keep_running(name, loop), name)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if not self._tasks:
            return
        _, stuck = await asyncio.wait(list(self._tasks), timeout=self._stop_s)
        for task in stuck:
            log.error("task_not_stopped", task=task.get_name(), after_s=self._stop_s)

    async def _keep_running(self, name: str, loop: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        faults = 0
        while True:
            began = time.monotonic()
            try:
                await loop()
            except Exception:  # cancellation (close) is a BaseException and ends the loop for good
                log.exception("task_crashed", task=name)
            else:
                log.error("task_returned", task=name)  # these loops run until cancelled
            self._down.add(name)
            faults = 1 if time.monotonic() - began >= self._max_backoff_s else faults + 1
            delay = min(self._max_backoff_s, self._backoff_s * 2 ** (faults - 1))
            await asyncio.sleep(delay)
            log.info("task_restarted", task=name, faults=faults, after_s=delay)
            self._down.discard(name)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(task.exception()))


class ServiceRuntime(Generic[C]):
    """Base of the services: subclasses set `nats_name`, implement `start()`, and may override
    `withdraw()` / `release()`. `run_torch` and `tasks` are what their state objects hold on to."""

    nats_name = ""  # NATS client name and micro-service name ($SRV discovery), e.g. droidmesh-broker
    restart_backoff_s = 0.5  # first delay before a crashed background loop is restarted

    def __init__(self, service: str, cfg: C, bus: Bus | None = None):
        self.service, self.cfg = service, cfg
        self.metrics = Metrics(service)
        self.tasks = Supervisor(self.restart_backoff_s)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")  # torch runs only here
        self.phase = "created"  # what start() is doing: named in the log when a signal stops it
        self._given_bus = bus  # in-process wiring (tests): used as is, never closed here
        self._own_bus: NatsBus | None = None
        self.health: HealthServer | None = None  # /metrics /livez /readyz, when metrics_port >= 0
        self._started = self._stopping = False

    @property
    def ready(self) -> bool:
        """What /readyz reports (read from the health thread: plain flags only)."""
        return self._started and not self._stopping and self.tasks.healthy

    async def start(self) -> None:
        """Load, connect, subscribe; return once requests can be served. Raise to fail the start."""
        raise NotImplementedError

    async def withdraw(self) -> None:
        """Stopping, the bus still open: tell the mesh this copy is going (default: nothing)."""

    async def release(self) -> None:
        """Stopping, the bus drained: close what the answered requests used (default: nothing)."""

    async def run_torch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking torch work on the service's single worker thread, never on the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def host_model(self, given: ModelAdapter | None, path: str, *, device: str, dtype: str, name: str
                         ) -> tuple[ModelAdapter, str]:
        """The model this copy serves text with (`given`, or loaded from `path` on the torch thread)
        and the sha256 of its weights, which pair configs are bound to."""
        from droidmesh.shared.model.adapter import load_model  # here, not at import: the broker never loads torch
        from droidmesh.shared.model.names import weights_sha256

        self.phase = "loading_model"
        model = given or await self.run_torch(functools.partial(load_model, path, device=device, dtype=dtype, name=name))
        if model.tokenizer is None:
            raise ConfigError(f"{path} has no tokenizer; the {self.service} serves text")
        return model, await self.run_torch(weights_sha256, Path(path))

    async def connect(self) -> Bus:
        """The service's bus: the one passed in, or its own NATS connection (retried forever
        until it connects; a signal still stops the service meanwhile)."""
        if self._given_bus is not None:
            return self._given_bus
        self.phase = "connecting"
        opts = self.cfg.nats_options()
        log.info("nats_connecting", servers=[_without_credentials(u) for u in opts["servers"]])
        self._own_bus = await NatsBus.connect(None, self.nats_name, __version__, **opts)
        log.info("nats_connected")
        return self._own_bus

    async def __aenter__(self) -> Self:
        self.phase = "starting"
        self.health = _start_health(self.metrics, self.cfg.metrics_host, self.cfg.metrics_port, lambda: self.ready)
        try:
            await self.start()
            if self._own_bus is not None:  # its subscriptions live at the server before "ready" is said
                await self._own_bus.flush()
        except BaseException:  # failed or cancelled (a signal while connecting): clean up, re-raise
            await self._close()
            raise
        self._started, self.phase = True, "serving"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _close(self) -> None:
        self._stopping = True  # /readyz fails first: no new traffic is routed here
        await self.tasks.close()
        await self.withdraw()
        if self._own_bus is not None:
            await self._own_bus.close()  # drain: requests already taken are answered
        await self.release()
        self.executor.shutdown(wait=True)
        if self.health is not None:
            await self.health.close()


def _quiet_transformers() -> None:
    """Services log JSON lines: transformers' progress bars ("Loading weights") would land in
    them as raw terminal text, so they are off in every service process. transformers reads
    the switch when it is imported (later, with the model); one imported already is told
    directly. Importing it here would cost the broker, which never loads a model, a second."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def _start_health(metrics: Metrics, host: str, port: int, ready: Callable[[], bool]) -> HealthServer | None:
    """Serve /metrics /livez /readyz on `host`:`port` (0: any free port, logged; -1: off)."""
    if port < 0:
        return None
    health = HealthServer(metrics, port, ready, host=host)
    health.start()
    log.info("health_listening", host=host, port=health.port)
    return health


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


async def run_until_signalled(service: ServiceRuntime[Any]) -> None:
    """Start `service`, serve until SIGTERM / SIGINT, then stop it cleanly. The handlers are in
    place before the start begins: a signal during the start cancels it (and its cleanup runs)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    starting = loop.create_task(service.__aenter__(), name="start")
    signalled = loop.create_task(stop.wait(), name="signals")
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stopping", signal=received[0], phase=service.phase)
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        log.info("stopped")
        return
    signalled.cancel()
    starting.result()  # a failed start raises here, its cleanup already done
    log.info("ready")
    await stop.wait()
    log.info("stopping", signal=received[0], phase=service.phase)
    await service.__aexit__(None, None, None)
    log.info("stopped")


GIL_SWITCH_S = 0.0005


def main(config: type[C], service: str, make: Callable[[C], ServiceRuntime[C]], argv: Sequence[str] | None) -> None:
    """Config -> logging -> run until signalled. A bad config or a failed start is one line and
    a non-zero exit status (2: configuration, 1: start), never a traceback."""
    try:
        cfg = settings.load(config, service, argv)
    except ValueError as e:  # ConfigError, or a check a config's __post_init__ delegates to
        print(f"{service}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(service, cfg.log_level)
    _quiet_transformers()
    # The event loop answers the bus while the torch thread runs the model's Python between
    # kernels; at CPython's default 5 ms switch interval a lookup or a decision can wait that long
    # for the GIL. 0.5 ms bounds that wait at the cost of more (cheap) switches.
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        asyncio.run(run_until_signalled(make(cfg)))
    except (DroidMeshError, OSError) as e:
        log.error("start_failed", error=str(e), code=getattr(e, "code", type(e).__name__))
        raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed
        raise SystemExit(130) from None
    exit_now(0)


def exit_now(status: int) -> None:
    """End a service that has stopped cleanly (`stopped` logged: every connection drained, every
    loop and the torch thread joined) without the interpreter's finalization: its last garbage
    collection walks the whole heap of torch and transformers objects, seconds of CPU on a busy
    host for nothing, since the kernel frees memory, memfds and sockets, and the sandboxes end
    with us (parent-death signal). Output is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
