"""The service runtime: health before start, supervised loops, signals during start, cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

import pytest
import structlog

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.service.runtime import ServiceRuntime, Supervisor, run_until_signalled
from droidmesh.shared.service.settings import BusSettings

DEADLINE_S = 30.0  # a bound on waits, not a timing expectation


async def until(pred: Callable[[], bool], what: str) -> None:
    """Yield to the loop until `pred()` holds; fail after DEADLINE_S."""
    end = asyncio.get_running_loop().time() + DEADLINE_S
    while not pred():
        assert asyncio.get_running_loop().time() < end, f"never: {what}"
        await asyncio.sleep(0)


def get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Toy(ServiceRuntime[BusSettings]):
    """A service whose `start()` is whatever the test hands it."""

    restart_backoff_s = 0.01

    def __init__(self, start: Callable[[Toy], Awaitable[None]], metrics_port: int = -1):
        super().__init__("toy", BusSettings(metrics_port=metrics_port), InProcessBus())
        self._start = start
        self.released = False

    async def start(self) -> None:
        await self.connect()
        await self._start(self)

    async def release(self) -> None:
        self.released = True


def test_crashed_loop_is_restarted_and_readiness_follows():
    """A supervised loop that raises is restarted; the service is not ready from the crash until then."""
    runs: list[int] = []
    crash, resume = asyncio.Event(), asyncio.Event()

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            await crash.wait()
            raise ConnectionError("bus gone")
        await resume.wait()

    async def start(rt: Toy) -> None:
        rt.tasks.supervise("beat", loop)

    async def run() -> list[bool]:
        seen = []
        async with Toy(start) as rt:
            await until(lambda: len(runs) == 1, "first run")
            seen.append(rt.ready)
            crash.set()
            await until(lambda: not rt.ready, "not ready after the crash")
            seen.append(rt.ready)
            await until(lambda: rt.ready, "ready again")
            seen.append(rt.ready)
            assert len(runs) == 2
        seen.append(rt.ready)
        return seen

    assert asyncio.run(run()) == [True, False, True, False]


def test_one_shot_task_failure_keeps_the_service_ready():
    """A spawned one-shot task that fails is logged, not restarted, and does not affect readiness."""
    runs: list[int] = []

    async def warm() -> None:
        runs.append(1)
        raise OSError("peer gone")

    async def start(rt: Toy) -> None:
        rt.tasks.spawn(warm(), "warm")

    async def run() -> bool:
        async with Toy(start) as rt:
            await until(lambda: bool(runs), "the task ran")
            for _ in range(10):
                await asyncio.sleep(0)
            return rt.ready

    assert asyncio.run(run()) is True
    assert runs == [1]


def test_health_answers_before_the_start_finishes():
    """/livez is 200 while the start is still loading; /readyz is 503 until it is done, then 200."""
    loading, loaded = asyncio.Event(), asyncio.Event()

    async def start(rt: Toy) -> None:
        loading.set()
        await loaded.wait()

    async def run() -> list[int]:
        rt = Toy(start, metrics_port=0)
        entering = asyncio.get_running_loop().create_task(rt.__aenter__())
        await loading.wait()
        assert rt.health is not None
        port = rt.health.port
        codes = [await asyncio.to_thread(get, port, "/livez"), await asyncio.to_thread(get, port, "/readyz")]
        loaded.set()
        await entering
        codes.append(await asyncio.to_thread(get, port, "/readyz"))
        await rt.__aexit__(None, None, None)
        return codes

    assert asyncio.run(run()) == [200, 503, 200]


def test_failed_start_cleans_up_and_raises():
    """A start that raises leaves nothing running: tasks cancelled, release() called, error re-raised."""
    cancelled: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def start(rt: Toy) -> None:
        rt.tasks.supervise("forever", forever)
        await asyncio.sleep(0)
        raise ConfigError("model has no tokenizer")

    async def run() -> Toy:
        rt = Toy(start)
        try:
            await rt.__aenter__()
        except ConfigError:
            return rt
        raise AssertionError("the start did not fail")

    rt = asyncio.run(run())
    assert rt.released and not rt.ready and cancelled == [True]


def test_sigterm_during_start_stops_the_service():
    """SIGTERM while the start is still waiting (an unreachable NATS) cancels it and cleans up."""
    waiting = asyncio.Event()

    async def start(rt: Toy) -> None:
        rt.phase = "connecting"
        waiting.set()
        await asyncio.Event().wait()  # never connects

    async def run() -> Toy:
        rt = Toy(start)
        serving = asyncio.get_running_loop().create_task(run_until_signalled(rt))
        await waiting.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, DEADLINE_S)
        return rt

    rt = asyncio.run(run())
    assert rt.released and rt.phase == "connecting" and not rt.ready


def test_supervisor_close_cancels_supervised_loops():
    """close() ends supervised loops for good: they are cancelled, not restarted."""
    runs: list[int] = []

    async def loop() -> None:
        runs.append(1)
        await asyncio.Event().wait()

    async def run() -> bool:
        sup = Supervisor(backoff_s=0.01)
        sup.supervise("loop", loop)
        await until(lambda: bool(runs), "the loop ran")
        await sup.close()
        for _ in range(10):
            await asyncio.sleep(0)
        return sup.healthy

    assert asyncio.run(run()) is True
    assert runs == [1]


def test_the_health_port_binds_the_configured_host_only():
    """Metrics name models and pairs: by default they answer on loopback, not every interface."""
    from droidmesh.shared.service.metrics import HealthServer, Metrics

    local = HealthServer(Metrics("toy"), 0, lambda: True)
    wide = HealthServer(Metrics("toy"), 0, lambda: True, host="0.0.0.0")
    try:
        assert local._httpd.server_address[0] == "127.0.0.1"
        assert wide._httpd.server_address[0] == "0.0.0.0"
    finally:
        local._httpd.server_close()
        wide._httpd.server_close()
    with pytest.raises(ConfigError, match="metrics_host"):
        BusSettings(metrics_host="example.org")


def test_a_service_is_started_only_once_its_own_connection_is_flushed():
    """Its subscriptions are live at the server before it says "ready" (else a request that
    follows the ready line can find no responder)."""
    order: list[str] = []

    class Flushing:
        async def flush(self, timeout: float = 10.0) -> None:
            order.append("flush")

        async def close(self) -> None:
            order.append("close")

    async def start(toy: Toy) -> None:
        toy._own_bus = Flushing()  # type: ignore[assignment]  # as `connect` sets a NATS connection
        order.append("subscribed")

    async def body() -> None:
        async with Toy(start) as toy:
            assert toy.ready
            order.append("ready")

    asyncio.run(body())
    assert order == ["subscribed", "flush", "ready", "close"]


def test_a_task_that_swallows_its_cancellation_does_not_hang_the_stop():
    """A library that catches CancelledError (nats-py does, while flushing) leaves its task
    running: `close` stops waiting for it after `stop_s` and says which task it left."""

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # the first cancellation is swallowed, as the library does
        await asyncio.sleep(3600)  # a second one ends it

    async def go() -> list[str]:
        sup = Supervisor(stop_s=0.2)
        sup.supervise("stubborn", stubborn)
        sup.spawn(asyncio.sleep(3600), "polite")
        await asyncio.sleep(0)
        await asyncio.wait_for(sup.close(), 30)  # the bound under test is stop_s; 30 s only catches a hang
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return [t.get_name() for t in left]

    with structlog.testing.capture_logs() as logs:
        left = asyncio.run(go())
    assert left == ["stubborn"]  # the polite task ended within the stop; the stubborn one was left
    assert [e["task"] for e in logs if e["event"] == "task_not_stopped"] == ["stubborn"]
