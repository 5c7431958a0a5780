"""`droidmesh serve`: a local mesh serving one base model and its adapters, in the foreground.

What runs: nats-server under the roster's users (fresh passwords, anonymous connections refused,
as `droidmesh demo` runs it), one broker, ONE receiver process that serves the base and every
adapter from one copy of the base weights (each under its own model id) and holds what it
prefills, so a later request over the same document (to the same model, or to another with a
pair config) reuses it; and the OpenAI gateway on loopback. The pair configs found among the
served models are published before the receiver starts, so no first request misses one
(`serve_config` finds, reads and binds them).

`plan_models` checks the command line before anything starts (each adapter is an adapter of the
base, names are unique ids). `run` starts the mesh, waits until the gateway's `/health` lists
every served model (with API keys, the mesh's discovery names them), hands the caller what to
print, then watches the children: SIGINT or SIGTERM stops them all (gateway first, nats-server
last) and returns 0; a child that exits on its own is reported with its last log lines, the rest
are stopped and `ServeFailed` is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import psutil

from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, valid_id
from droidmesh.shared.model.device import DEVICE_ENV
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import Proc, start_secure_nats, start_service
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS
from droidmesh.shared.tools.apps.serve_config import Published
from droidmesh.shared.zoo.manifest import resolve_model

RECEIVER_START_S = 900.0  # a base and its adapters loading on a small CPU
READY_S = 60.0  # from the gateway's start until its /health lists every served model
STOP_GRACE_S = 15.0


class ServeFailed(DroidMeshError):
    """A process of the mesh failed to start or exited on its own; the rest were stopped."""

    code = "serve_failed"


@dataclasses.dataclass(frozen=True)
class Served:
    """A model as served: `id` is its model name in the API, `ref` the checkpoint (named as resolved)."""

    id: str
    ref: ModelRef

    @property
    def as_served(self) -> ModelRef:
        """`ref` renamed to the served id: what a pair config binds."""
        return dataclasses.replace(self.ref, name=self.id)


@dataclasses.dataclass(frozen=True)
class ServePlan:
    base: Served
    adapters: tuple[Served, ...]

    @property
    def models(self) -> tuple[Served, ...]:
        return (self.base, *self.adapters)

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.models]

    @property
    def holder_id(self) -> str:
        return f"{self.base.id}-holder"


def _check_id(name: str, what: str) -> None:
    if not valid_id(name):  # the roster gives each served model a NATS user and subjects
        raise ConfigError(f"{what} {name!r}: a model id is letters, digits, '_' and '-' only (use NAME=MODEL)")


def adapter_spec(spec: str) -> tuple[str | None, str]:
    """`NAME=MODEL` -> (NAME, MODEL); `MODEL` alone -> (None, MODEL): served under its model name."""
    name, eq, model = spec.partition("=")
    if not eq:
        return None, spec
    if not name or not model:
        raise ConfigError(f"--adapter {spec!r}: expected NAME=MODEL or MODEL")
    return name, model


def plan_models(base: str, adapters: Sequence[str]) -> ServePlan:
    """Resolve and check what to serve; `ConfigError` (one line) for a model that is not there,
    a base that is an adapter, an adapter that is not one of the base's, or an id given twice."""
    from droidmesh.shared.model.adapter import lora_base  # imports torch: only once there is a base

    base_ref = resolve_model(base)
    if (base_ref.path / "adapter_config.json").is_file():
        raise ConfigError(f"{base_ref.label} is an adapter (of {lora_base(base_ref.path)}): serve its base and "
                          f"add it with --adapter {base_ref.label}")
    _check_id(base_ref.name, "the base's model id")
    served = [Served(base_ref.name, base_ref)]
    base_dir = base_ref.path.resolve()
    for spec in adapters:
        name, model = adapter_spec(spec)
        ref = resolve_model(model)
        mid = name or ref.name
        _check_id(mid, f"--adapter {spec!r}: the id")
        if not (ref.path / "adapter_config.json").is_file():
            raise ConfigError(f"--adapter {spec!r}: {ref.label} is a full checkpoint, not an adapter (a PEFT "
                              "directory with adapter_config.json); serve it as a base of its own")
        parent = lora_base(ref.path)
        if parent is None or parent.resolve() != base_dir:
            raise ConfigError(f"--adapter {spec!r}: {ref.label} is an adapter of {parent}, not of the base "
                              f"{base_ref.label} ({base_dir})")
        for other in served:
            if other.id == mid:
                raise ConfigError(f"--adapter {spec!r}: the model id {mid!r} is served already; "
                                  "name it with NAME=MODEL")
            if other.ref.path.resolve() == ref.path.resolve():
                raise ConfigError(f"--adapter {spec!r}: {ref.label} is served already (as {other.id!r})")
        served.append(Served(mid, ref))
    return ServePlan(served[0], tuple(served[1:]))


# -- the mesh ------------------------------------------------------------------------------------
def roster(plan: ServePlan) -> Roster:
    """The NATS users: one receiver user (the base's) for the process serving every model, which
    also announces what it holds under `holder_id`; no senders."""
    return Roster.local((), [plan.base.id], hosted={plan.base.id: [a.id for a in plan.adapters]},
                        holders={plan.base.id: plan.holder_id})


def receiver_args(plan: ServePlan, transport: str) -> dict[str, object]:
    """The receiver's flags: the base as `--model-id`, each adapter as NAME=PATH, holding on."""
    args: dict[str, object] = {"model_path": plan.base.ref.path, "model_id": plan.base.id, "transport": transport,
                               "holder_id": plan.holder_id}
    if plan.adapters:
        args["adapters"] = [f"{a.id}={a.ref.path}" for a in plan.adapters]
    return args


@dataclasses.dataclass(frozen=True)
class Options:
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str | None = None
    transport: str = "shm"


@dataclasses.dataclass(frozen=True)
class Ready:
    """What the caller prints once the mesh answers: where to send requests and what is published."""

    url: str  # the OpenAI base URL, http://HOST:PORT/v1
    health: str
    models: list[str]
    published: list[Published]
    log_dir: Path


class _Stop(Exception):
    """SIGINT / SIGTERM arrived (raised in the main thread by the handler)."""


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(plan: ServePlan, published: Sequence[Published], opts: Options, log_dir: Path | None,
        say: Callable[[str], None], ready: Callable[[Ready], None]) -> None:
    """Start the mesh, call `ready` once the gateway lists every model, serve until SIGINT / SIGTERM
    (return) or until a child exits on its own (`ServeFailed`); every child is stopped either way."""
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    store = tempfile.mkdtemp(prefix="droidmesh-serve-js-")  # JetStream state: this run's only
    procs: list[Proc] = []
    others = {c.pid for c in psutil.Process().children()}  # a host process's own children are not ours
    handlers = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        say(f"logs in {log_dir}")
        access = _start(plan, published, opts, log_dir, store, procs, say)
        url = _url(opts.host, _port(procs[-1]))
        models = _until_listed(f"{url}/health", plan.ids, procs, READY_S, lambda: asyncio.run(_discover(access)))
        if models is not None:
            ready(Ready(f"{url}/v1", f"{url}/health", models, list(published), log_dir))
        dead = _watch(procs)
        how = _status(dead.popen.returncode)
        say(f"{dead.name} exited on its own ({how}); its last log lines:")
        for line in dead.lines[-20:]:
            say(f"  | {line}")
        raise ServeFailed(f"{dead.name} exited on its own ({how}); stopped the rest; logs in {log_dir}")
    except _Stop as e:
        say(f"{e}: stopping every process")
    except (RuntimeError, TimeoutError) as e:  # a start failed: its message ends with the process's last lines
        head, _, tail = str(e).partition("\n")
        for line in tail.splitlines()[-20:]:
            say(f"  | {line}")
        raise ServeFailed(f"{head}; stopped the rest; logs in {log_dir}") from None
    finally:
        for s in handlers:  # a second Ctrl-C must not cut the stop short
            signal.signal(s, signal.SIG_IGN)
        for p in reversed(procs):
            say(f"stopping {p.name}")
            p.stop(STOP_GRACE_S)
        _stop_strays(others, say)
        shutil.rmtree(store, ignore_errors=True)
        for s, h in handlers.items():
            signal.signal(s, h)
        say("stopped")


def _start(plan: ServePlan, published: Sequence[Published], opts: Options, log_dir: Path, store: str,
           procs: list[Proc], say: Callable[[str], None]) -> MeshAccess:
    env = {DEVICE_ENV: opts.device, **({"DM_DTYPE": opts.dtype} if opts.dtype else {}), **NO_HEALTH_PORT}
    say("starting nats-server (a user per role, fresh passwords, anonymous connections refused)")
    nats, access = start_secure_nats(roster(plan), store_dir=store, log_dir=log_dir)
    procs.append(nats)
    say(f"nats-server ready on {access.url}")
    if published:
        asyncio.run(_publish(published, access))
        for p in published:
            say(f"published {p.pair}: {p.plan}")
    say("starting the broker")
    procs.append(start_service("cache_broker", {}, access.url, log_dir=log_dir,
                               env={**THREADS, **NO_HEALTH_PORT, **access.env_for("broker")}))
    what = plan.base.id + "".join(f", {a.id}" for a in plan.adapters)
    say(f"starting the receiver of {what} on {opts.device} (loading the weights takes a while)")
    began = time.monotonic()
    procs.append(start_service("receiver", receiver_args(plan, opts.transport), access.url,
                               name=f"receiver-{plan.base.id}", log_dir=log_dir, timeout=RECEIVER_START_S,
                               env={**env, **access.env_for(receiver_user(plan.base.id))}))
    say(f"receiver ready in {time.monotonic() - began:.0f} s")
    say(f"starting the gateway on {opts.host}:{opts.port}")
    procs.append(start_service("gateway", {"http_host": opts.host, "http_port": opts.port}, access.url,
                               log_dir=log_dir, env={**THREADS, **NO_HEALTH_PORT, **access.env_for("gateway")}))
    return access


async def _publish(published: Sequence[Published], access: MeshAccess) -> None:
    """Maps files first (a receiver that sees a config can fetch its maps at once), then configs;
    as the profiler, the role that writes both buckets."""
    client = await MeshClient.connect(access.url, **access.options("profiler"))
    try:
        maps = client.bus.maps_store()
        for p in published:
            for data in p.maps.values():
                await maps.put(data)
        board = client.bus.config_board()
        for p in published:
            await board.put(p.cfg)
    finally:
        await client.close()


def _port(gateway: Proc) -> int:
    return int(gateway.events("gateway_started")[0]["http_port"])


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _until_listed(health: str, ids: list[str], procs: list[Proc], timeout: float,
                  discover: Callable[[], list[str]]) -> list[str] | None:
    """Poll the gateway's /health until every served model is listed: the list it gave (None: a
    child exited meanwhile, which the watch that follows reports). A gateway with API keys answers
    `status` without the models (an unauthenticated probe learns nothing it serves); then the
    models are the mesh's own discovery, asked as the gateway's user (`discover`)."""
    deadline, seen = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        if any(p.popen.poll() is not None for p in procs):
            return None
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                body = json.loads(r.read())
            listed = body["models"] if "models" in body else discover()
            if set(ids) <= set(listed):
                return sorted(listed)
            seen = f"models {sorted(listed)}"
        except (OSError, ValueError, DroidMeshError) as e:  # 503 until the gateway has joined the mesh
            seen = str(getattr(e, "reason", e))
        time.sleep(0.5)
    raise TimeoutError(f"the gateway did not list {', '.join(ids)} within {timeout:.0f} s (last: {seen})")


async def _discover(access: MeshAccess) -> list[str]:
    """The receiver models the mesh's discovery finds, as the gateway's user sees them."""
    client = await MeshClient.connect(access.url, **access.options("gateway"))
    try:
        return sorted(m.model_id for m in await client.receivers())
    finally:
        await client.close()


def _status(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"status {rc}"


def _watch(procs: list[Proc], poll_s: float = 0.5) -> Proc:
    """Block until one of `procs` exits; that one."""
    while True:
        for p in procs:
            if p.popen.poll() is not None:
                return p
        time.sleep(poll_s)


def _stop_strays(others: set[int], say: Callable[[str], None]) -> None:
    """Stop a service or nats-server child left outside `procs` (one whose start a signal cut
    short), leaving the children in `others` (there before `run`) alone."""
    strays = []
    for c in psutil.Process().children():
        try:
            if c.pid not in others and any("droidmesh.services." in a or a.endswith("nats-server") for a in c.cmdline()):
                strays.append(c)
        except psutil.Error:  # gone meanwhile
            pass
    for c in strays:
        say(f"stopping stray child {c.pid}")
        with contextlib.suppress(psutil.NoSuchProcess):
            c.terminate()
    _, alive = psutil.wait_procs(strays, timeout=STOP_GRACE_S)
    for c in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            c.kill()


def instructions(r: Ready, plan: ServePlan) -> list[str]:
    """The lines printed once the mesh answers: where to send requests, and how."""
    adapters = ", ".join(f"{a.id} ({a.ref.label})" for a in plan.adapters) or "none"
    example = plan.adapters[0].id if plan.adapters else plan.base.id
    configs = ("; ".join(f"{p.pair}: {p.plan}" for p in r.published)
               or "none (reuse across models needs one; each model still reuses what it holds)")
    body = json.dumps({"model": example, "prompt": "DroidMesh reuses KV caches across fine-tunes of one base."
                       "\n\nQuestion: What does DroidMesh reuse?\nAnswer:", "max_tokens": 16, "temperature": 0})
    return [
        f"serving {plan.base.ref.label} as {plan.base.id}; adapters: {adapters}",
        f"  OpenAI API  {r.url}  (no API key needed on loopback: any api_key works)",
        f"  health      {r.health}  (GET {r.url}/models lists the models)",
        f"  models      {', '.join(r.models)}",
        f"  configs     {configs}",
        f"  logs        {r.log_dir}",
        "",
        "curl:",
        f"  curl -sS {r.url}/completions -H 'Content-Type: application/json' \\",
        f"      -d '{body}'",
        "",
        "python (pip install openai):",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{r.url}", api_key="unused")',
        f'  reply = client.completions.create(model="{example}", prompt="...", max_tokens=16, temperature=0)',
        '  print(reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens, reply.model_extra["droidmesh"])',
        "",
    ]


def ready_line(r: Ready) -> str:
    return f"ready: {r.url} (Ctrl-C stops every process)"
