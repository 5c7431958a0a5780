"""Startup: a service that cannot reach NATS is alive but not ready, and stops on SIGTERM."""

from __future__ import annotations

import sys

import pytest

from droidmesh.shared.service.launch import Proc, free_port
from tests.system.conftest import health_port, http_get

pytestmark = pytest.mark.system


def test_sigterm_while_connecting_to_an_unreachable_nats(services):
    """A broker pointed at a port nobody listens on serves /livez 200 and /readyz 503 while it
    retries, and on SIGTERM logs where it was and exits 0 (the wait is a deadline)."""
    url = f"nats://127.0.0.1:{free_port()}"  # free: nothing listens there
    proc = Proc("broker", [sys.executable, "-m", "droidmesh.services.cache_broker", "--nats-url", url, "--metrics-port", "0"],
                env={"PYTHONUNBUFFERED": "1"})
    services.append(proc)
    proc.wait_for(lambda l: '"event": "nats_connecting"' in l, 60, "connecting")
    proc.wait_for(lambda l: '"event": "nats_error"' in l, 60, "a failed connection attempt")
    port = health_port(proc)
    assert http_get(port, "/livez")[0] == 200 and http_get(port, "/readyz")[0] == 503
    proc.signal_stop()  # SIGTERM; `stop` then waits for the exit and for its last lines to be read
    assert proc.stop(grace=60) == 0, proc.tail()
    (stopping,) = proc.events("stopping")
    assert stopping["signal"] == "SIGTERM" and stopping["phase"] == "connecting"
    assert proc.events("stopped") and not proc.events("ready")
