"""The broker on the service runtime: its expiry loop is supervised, and its process has no torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.shared.mesh.bus import InProcessBus
from tests.unit.test_runtime import until


class FastBroker(BrokerService):
    restart_backoff_s = 0.01


def test_expiry_loop_that_crashes_is_restarted():
    """An expiry sweep that raises makes the broker not ready until the loop is back and sweeping."""
    sweeps: list[str] = []

    async def run() -> list[bool]:
        broker = FastBroker(BrokerConfig(expire_every_s=0.01), bus=InProcessBus())
        expire = broker.index.expire

        def flaky_expire() -> list[str]:
            sweeps.append("crash" if not sweeps else "ok")
            if len(sweeps) == 1:
                raise RuntimeError("index corrupted")
            return expire()

        broker.index.expire = flaky_expire  # type: ignore[method-assign]  # swap in a failing sweep
        async with broker:
            await until(lambda: not broker.ready, "not ready after the crash")
            seen = [broker.ready]
            await until(lambda: sweeps.count("ok") >= 2, "sweeping again")
            seen.append(broker.ready)
        return seen

    assert asyncio.run(run()) == [False, True]
    assert sweeps[0] == "crash"


def test_broker_process_imports_no_torch():
    """Starting the broker's entrypoint (to --help) imports neither torch nor transformers."""
    code = ("import runpy, sys\n"
            "sys.argv = ['droidmesh.services.cache_broker', '--help']\n"
            "try:\n    runpy.run_module('droidmesh.services.cache_broker', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr
