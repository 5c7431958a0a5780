"""The one place a local mesh starts: nats-server under a roster of per-role users, the
control plane (broker, published pair configs), senders and clients, for the demo, the agents,
`droidmesh serve` and the benchmarks alike (`shared/service/launch.py` starts each process).

The mesh runs as deployments do: nats-server under the roster's users and permissions
(`start_secure_nats`, fresh passwords), every service and client logged in as its role; its
services run many to a host, one torch thread each (`THREADS`), none on the health port an image
sets for its one service. Everything here blocks (a service start waits for its `ready` event)
except the clients (`connect_as`, `publish_configs`: coroutines).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, sender_user
from droidmesh.shared.model.device import DEVICE_ENV
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling.published import recompute_config
from droidmesh.shared.service.launch import Proc, start_secure_nats, start_service
from droidmesh.shared.wire import schemas

THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one torch thread per process: many share a host
# The local mesh's services run many to a host: none takes the health port an image sets for its one service.
NO_HEALTH_PORT = {"DM_METRICS_PORT": "-1"}


def launched_env(device: str) -> dict[str, str]:
    """Environment of a launched model process: one torch thread, models on `device`. The
    services keep `dtype` bfloat16 given explicitly, on any device."""
    return {**THREADS, DEVICE_ENV: device}


@contextmanager
def mesh(roster: Roster, host: str = "127.0.0.1", wrap: list[str] | None = None
         ) -> Iterator[tuple[MeshAccess, list[Proc]]]:
    """A nats-server on `host` (run under `wrap`, e.g. `ip netns exec NS`) for `roster`'s users:
    yields (access, procs). A suite appends the services it starts to `procs` (and may remove one
    it stopped itself); on the way out every process left in it is stopped, last started first."""
    procs: list[Proc] = []
    try:
        nats, access = start_secure_nats(roster, host=host, wrap=wrap)
        procs.append(nats)
        yield access, procs
    finally:
        for p in reversed(procs):
            p.stop()


async def connect_as(access: MeshAccess, *users: str) -> list[MeshClient]:
    """One client per user, in order (those already open are closed if a later one fails)."""
    clients: list[MeshClient] = []
    try:
        for user in users:
            clients.append(await MeshClient.connect(access.url, **access.options(user)))
    except BaseException:
        for c in clients:
            await c.close()
        raise
    return clients


def start_control_plane(pairs: Sequence[Pair], models: dict[str, ModelRef], profiles: dict[str, dict[str, Any]],
                        log_dir: Path, procs: list[Proc], relay: Sequence[schemas.RelayBucket] = (),
                        roster: Roster | None = None) -> MeshAccess:
    """nats-server under `roster`'s users (default: a sender per pair's sender model, the pairs'
    receivers), the pairs' saved profiles published as configs (with the relay audit's `relay`
    buckets), a broker (each appended to `procs`, logs in `log_dir`); the mesh's logins."""
    roster = roster or Roster.local((p.sender for p in pairs), (p.receiver for p in pairs))
    nats, access = start_secure_nats(roster, log_dir=log_dir)
    procs.append(nats)
    configs = [msgspec.structs.replace(recompute_config(profiles[p.id], models[p.sender], models[p.receiver], 1),
                                       relay=list(relay)) for p in pairs if p.id in profiles]
    asyncio.run(publish_configs(configs, access))
    procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **NO_HEALTH_PORT,
                                                                    **access.env_for("broker")}, log_dir=log_dir))
    return access


def start_sender(access: MeshAccess, model: ModelRef, model_id: str, e_layers: Sequence[int], log_dir: Path,
                 env: dict[str, str], paired: Iterable[str] = (), readers: Sequence[str] = (),
                 **args: object) -> Proc:
    """A sender of `model_id` whose id is its model's (its roster entry, `Roster.local`). It grants
    pulls to `readers` (receivers on a default group) and to the receivers of published pair
    configs; it is returned once it has read the configs of `paired` (its `reader_paired` log),
    so that no first request is refused for a pair it has not seen yet."""
    more = {"readers": list(readers)} if readers else {}
    proc = start_service("sender", {"model_path": model.path, "model_id": model_id, "sender_id": model_id,
                                    "e_layers": list(e_layers), **more, **args}, access.url,
                         name=f"sender-{model_id}", env={**env, **access.env_for(sender_user(model_id))},
                         log_dir=log_dir)
    try:
        for receiver in dict.fromkeys(paired):
            proc.wait_for(functools.partial(_paired, receiver), 60, f"the {model_id}-to-{receiver} pair config")
    except BaseException:
        proc.stop()
        raise
    return proc


def _paired(receiver: str, line: str) -> bool:
    if not (line.startswith("{") and '"reader_paired"' in line):
        return False
    try:
        return json.loads(line).get("receiver_model") == receiver
    except ValueError:  # a line of other output that merely looks like JSON
        return False


async def publish_configs(configs: list[schemas.RecomputeConfig], access: MeshAccess) -> None:
    """Put `configs` on the config board as the profiler, the role that writes it."""
    if not configs:
        return
    client = await MeshClient.connect(access.url, **access.options("profiler"))
    try:
        board = client.bus.config_board()
        for cfg in configs:
            await board.put(cfg)
    finally:
        await client.close()
