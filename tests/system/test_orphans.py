"""Nothing a launcher started outlives it: a Python parent that starts nats-server and a service
through `shared.service.launch` (and a benchmark's network namespaces through
`shared.tools.bench.netns`) is SIGKILLed, and every child and namespace it made goes away with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from droidmesh.shared.tools.bench import netns

pytestmark = pytest.mark.system

DEADLINE_S = 60.0  # generous: a SIGKILLed child is gone within milliseconds

# Starts nats-server from a thread that then exits (the parent-death signal follows the forking
# thread), and proves it still serves by starting a broker against it; prints the children's pids.
PARENT = textwrap.dedent("""
    import json, os, sys, threading
    from droidmesh.shared.service.launch import start_nats, start_service
    started = {}
    forker = threading.Thread(target=lambda: started.update(nats=start_nats()))
    forker.start()
    forker.join()
    tid_gone = f"/proc/self/task/{forker.native_id}"
    while os.path.exists(tid_gone):  # gone from the kernel too: any signal its exit sends is sent
        threading.Event().wait(0.01)
    nats, url = started["nats"]
    broker = start_service("cache_broker", {}, url, env={"OMP_NUM_THREADS": "1"})
    print(json.dumps({"pids": [nats.popen.pid, broker.popen.pid]}), flush=True)
    sys.stdin.read()
""")

# A benchmark's link with nats-server inside its sender namespace; prints the server's pid.
NETNS_PARENT = textwrap.dedent("""
    import json, sys
    from droidmesh.shared.tools.bench import netns
    from droidmesh.shared.service.launch import start_nats
    with netns.link() as (snd, rcv):
        nats, url = start_nats(host=netns.SND_IP, wrap=snd)
        print(json.dumps({"pids": [nats.popen.pid]}), flush=True)
        sys.stdin.read()
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not reaped yet
    except psutil.NoSuchProcess:
        return True


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        assert time.monotonic() < deadline, f"{what} after {DEADLINE_S}s"
        time.sleep(0.1)


def _link_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {n for n in (line.split()[0] for line in out.splitlines() if line.split()) if n.startswith(("dm-snd", "dm-rcv"))}


@pytest.fixture
def parent() -> Iterator[Callable[[str], tuple[subprocess.Popen, list[int]]]]:
    """Run a parent script; yields a function returning (its process, the children's pids it printed).
    Whatever survives a test is killed here, by pid: only processes these parents started."""
    started: list[tuple[subprocess.Popen, list[int]]] = []

    def run(script: str) -> tuple[subprocess.Popen, list[int]]:
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the parent's own readiness waits bound this (nats 30 s, service 120 s)
        assert line, f"the parent exited ({proc.wait()}) before it started its children"
        started.append((proc, json.loads(line)["pids"]))
        return started[-1]

    yield run
    for proc, pids in started:
        proc.kill()
        proc.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_children_die_with_a_sigkilled_parent(parent):
    """nats-server (started from a thread long gone) and a service: both gone once the parent is SIGKILLed."""
    proc, pids = parent(PARENT)
    assert not any(_gone(p) for p in pids), "a child died before its parent"
    proc.kill()
    proc.wait()
    _until(lambda: all(_gone(p) for p in pids), f"children {[p for p in pids if not _gone(p)]} outlived their parent")


def test_a_benchmarks_network_namespaces_do_not_outlive_it(parent):
    """The link's two namespaces and the nats-server inside one: gone once the parent is SIGKILLed."""
    why = netns.available()
    if why:
        pytest.skip(why)
    before = _link_namespaces()
    proc, pids = parent(NETNS_PARENT)
    made = _link_namespaces() - before
    assert len(made) == 2, made
    proc.kill()
    proc.wait()
    try:
        _until(lambda: all(_gone(p) for p in pids), "nats-server in the namespace outlived its parent")
        _until(lambda: not made & _link_namespaces(), f"namespaces {made & _link_namespaces()} outlived their parent")
    finally:
        for ns in made & _link_namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_namespaces_of_a_dead_owner_are_removed_at_the_next_start():
    """A link namespace whose owner pid is gone (its reaper killed with it) is deleted by `remove_stale`;
    one whose owner lives is kept."""
    why = netns.available()
    if why:
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = netns.names(dead.pid)[0], netns.names()[1]
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        removed = netns.remove_stale()
        assert stale in removed and live not in removed
        assert stale not in _link_namespaces() and live in _link_namespaces()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
