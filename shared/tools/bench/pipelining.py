"""`droidmesh bench pipeline`: does overlapping the pull with the compute pay, on one host?

Called by `shared/tools/cli/bench/data_plane.py`. Starts a nats-server and one sender process serving
over `transport`, then runs the probe (`shared/tools/bench/probe.py`) as the receiver in a child
process: it pulls over the channel the sender announces and times loading every layer's KV then
computing, loading the reused KV then computing, and computing while the reused KV streams in.
Blocks until the probe is done; every process is stopped on the way out.
"""

from __future__ import annotations

from typing import Any

from droidmesh.shared.mesh.nats_auth import Roster, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import launched_env, mesh
from droidmesh.shared.tools.bench.harness import run_probe


def run_pipeline(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
                 device: str = DEFAULT_DEVICE, transport: str = "ucx") -> dict[str, Any]:
    """The probe's figures (`seconds` per mode, `pipeline_overhead`, ...) plus `transport`."""
    with mesh(Roster.local(["bench-sender"], [])) as (access, procs):
        procs.append(start_service("sender", {"model_path": sender_path, "model_id": "bench-sender", "dtype": "bfloat16",
                                              "sender_id": "bench-sender", "e_layers": [group[0]], "transport": transport},
                                   access.url, env={**launched_env(device), **access.env_for(sender_user("bench-sender"))}))
        return {**run_probe(access, receiver_path, "bench-sender", tokens, group, repeats, device), "transport": transport}
