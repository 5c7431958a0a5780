"""`droidmesh bench bandwidth`: the pipeline probe across a rate-limited link, per link rate.

Called by `shared/tools/cli/bench/data_plane.py`; `bandwidth_env` and `CROSS_HOST_UCX_TLS` also by
`codec_sweep` (its mesh stage is this sweep's setup). Sender and nats-server run in one network
namespace, the probe in another, over a veth whose rate `netns.set_rate` sets with tc (needs root
and `ip`/`tc`: `netns.available` says why not). Blocks for the whole sweep; every process is
stopped and the namespaces removed on the way out. It trusts UCX's own protocol tables
(UCX_PROTO_INFO=y on stdout) to say which transport carried the payloads.
"""

from __future__ import annotations

import os
from typing import Any

from tqdm import tqdm

from droidmesh.shared.mesh.nats_auth import Roster, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import launched_env, mesh
from droidmesh.shared.tools.bench import netns
from droidmesh.shared.tools.bench.harness import run_probe
from droidmesh.shared.tools.bench.ucx_proto import UCX_GET, ucx_protocol_for, ucx_tables

# Two hosts share no memory: unless told otherwise, the bandwidth sweep's processes run UCX
# without its shared-memory transports. In two network namespaces of one kernel UCX still finds
# the peer on "this host" and, with CMA allowed (`shared/transport/ucx/`), reads the sender's
# memory with process_vm_readv: the bytes never cross the veth and the tc limit measures nothing
# (the "achieved" rate far above the configured one). An operator's UCX_TLS still wins.
CROSS_HOST_UCX_TLS = "tcp,self"
BANDWIDTH_PAYLOAD_BYTES = 1 << 20  # the size whose protocol row a bandwidth row reports (~ one layer's K or V)


def bandwidth_env(transport: str, ucx_tls: str | None) -> dict[str, str]:
    """Environment of the sweep's sender and probe: the bulk channel on both ends, UCX's protocol
    tables on stdout, and `ucx_tls` as UCX_TLS (None or "": the channel's own choice; an
    operator's UCX_TLS wins either way)."""
    env = {"DM_SENDER_TRANSPORT": transport, "DM_RECEIVER_TRANSPORT": transport, "UCX_PROTO_INFO": "y"}
    if ucx_tls:
        env["UCX_TLS"] = os.environ.get("UCX_TLS", ucx_tls)
    return env


def _row_ucx_transport(transport: str, sender_lines: list[str], probe_lines: list[str],
                       previous: str | None) -> str | None:
    """The UCX transport and protocol that carried this row's payloads (at 1 MiB, about one
    layer's K or V). ucx: the sender's last tag-send table printed during the row; UCX prints a
    table once per endpoint configuration, so a row whose endpoint matched an earlier one's
    keeps that row's answer. nixl: the probe's (a fresh process per row) get table."""
    if transport == "ucx":
        protocols = ucx_tables(sender_lines).get("host memory")
        if not protocols:
            return previous
    else:
        protocols = next(reversed(ucx_tables(probe_lines, UCX_GET).values()), None)  # the last, any memory type
        if not protocols:
            return None
    return ucx_protocol_for(BANDWIDTH_PAYLOAD_BYTES, protocols) or "unknown"


def run_bandwidth(sender_path: str, receiver_path: str, tokens: int, group: tuple[int, int], repeats: int,
                  rates_mbit: list[float | None], device: str = DEFAULT_DEVICE, transport: str = "ucx",
                  ucx_tls: str | None = CROSS_HOST_UCX_TLS) -> list[dict[str, Any]]:
    """The probe in its own namespace, the sender (and NATS) in another, per link rate (None:
    unlimited), over `transport` (both ends). Each row adds `configured_gbit_s`,
    `link_efficiency`, `transport`, `ucx_transports` (what UCX carried the payloads with) and
    `ucx_tls` to the probe's figures. Raises RuntimeError when namespaces are not available."""
    why = netns.available()
    if why:
        raise RuntimeError(f"bandwidth sweep skipped: {why}")
    env = bandwidth_env(transport, ucx_tls)
    rows = []
    roster = Roster.local(["bench-sender"], [])
    with netns.link() as (snd, rcv), mesh(roster, host=netns.SND_IP, wrap=snd) as (access, procs):
        login = access.env_for(sender_user("bench-sender"))
        sender = start_service("sender", {"model_path": sender_path, "model_id": "bench-sender",
                                          "sender_id": "bench-sender", "dtype": "bfloat16", "e_layers": [group[0]],
                                          "ucx_host": netns.SND_IP}, access.url,
                               env={**launched_env(device), **env, **login}, wrap=snd)
        procs.append(sender)
        chosen: str | None = None
        for rate in tqdm(rates_mbit, desc="bandwidth", unit="rate"):
            netns.set_rate(rate)
            seen, probe_lines = len(sender.lines), list[str]()
            r = run_probe(access, receiver_path, "bench-sender", tokens, group, repeats, device, wrap=rcv, env=env,
                          lines=probe_lines)
            chosen = _row_ucx_transport(transport, sender.lines[seen:], probe_lines, chosen)
            r["configured_gbit_s"] = rate / 1000 if rate else None
            r["link_efficiency"] = r["achieved_gbit_s"] / (rate / 1000) if rate else None
            r.update(transport=transport, ucx_transports=chosen, ucx_tls=env.get("UCX_TLS"))
            rows.append(r)
    return rows
