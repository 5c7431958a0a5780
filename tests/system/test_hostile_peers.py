"""Peers that speak valid NIXL and UCX against a real sender process: what they can read, and what
they can kill.

A sender (`python -m droidmesh.shared.tools.bench.tensor_server`, the channel's own server class) holds
two contexts, "38528" (A) and "40000" (B), each filled with its own canary, and needs a grant per
pull (`--grants`). An attacker process (`tests/system/attackers.py`, its own NIXL agent) then:
  nixl  without a grant: gets no agent metadata and nothing to connect to;
        with a grant for A: loads a forged descriptor of the granting agent covering the whole
        address space and READs 1 MiB windows around A (±1 MiB): no byte of B comes back;
        with a grant for A: READs address 0x1000 (over TCP the process that serves it dies);
  ucx   without a grant: its hello (a NIXL agent's real worker address) gets a refusal and no
        worker address; with a grant: a well-formed hello from a ucxx worker, then an endpoint
        from NIXL's UCX to the worker address it was welcomed with.
After each, the sender process is alive and still serves B, exactly, to an honest receiver with
its own grant. Before sandboxes the same attacks read B with and without a grant and killed the
sender with SIGSEGV (nixl over TCP; ucx on any transport). Each runs over the default transports
and over UCX_TLS=tcp, DM_ATTACK_RUNS times (1 in CI; the closing measurement ran 10).
Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from droidmesh.shared.service.launch import Proc
from droidmesh.shared.tools.bench.tensor_server import ADDRESS_PREFIX, GRANT_PREFIX, canary
from droidmesh.shared.transport.bulk import make_client
from droidmesh.shared.wire.schemas import PullItem, PullRequest

pytestmark = [pytest.mark.system, pytest.mark.security]
pytest.importorskip("nixl_cu12")

A, B = "38528", "40000"
RUNS = int(os.environ.get("DM_ATTACK_RUNS", "1"))
IO_S = 120.0
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TLS = {"default": {}, "tcp": {"UCX_TLS": "tcp"}}


class Sender:
    def __init__(self, channel: str, tls: str, services: list[Proc]):
        self.env = {**ENV, **TLS[tls]}
        argv = [sys.executable, "-m", "droidmesh.shared.tools.bench.tensor_server", channel, f"{A},{B}",
                "--grants", str(3 * RUNS + 2), "--fill", "canary"]
        self.proc = Proc(f"sender-{channel}-{tls}", argv, env=self.env)
        services.append(self.proc)
        line = self.proc.wait_for(lambda l: l.startswith((ADDRESS_PREFIX, "BULK_ERROR=")), IO_S, "its address")
        if not line.startswith(ADDRESS_PREFIX):
            pytest.skip(f"{channel} unavailable here: {line}")
        self.address = line[len(ADDRESS_PREFIX):]
        self.grants: dict[str, list[str]] = {A: [], B: []}
        for l in self.proc.lines:
            if l.startswith(GRANT_PREFIX):
                cid, token = l[len(GRANT_PREFIX):].split(" ")
                self.grants[cid].append(token)

    def grant(self, cid: str) -> str:
        return self.grants[cid].pop()

    def attack(self, channel: str, *args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "tests.system.attackers", channel, self.address, *args],
                             capture_output=True, text=True, timeout=IO_S, env={**os.environ, **self.env})
        line = [l for l in out.stdout.splitlines() if l.startswith("ATTACK=")]
        assert line, f"the attacker failed (status {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return json.loads(line[0][len("ATTACK="):])

    def assert_alive_and_serving(self, channel: str) -> None:
        """The sender process runs, and an honest receiver pulls B (its canary, exactly)."""
        assert self.proc.popen.poll() is None, f"the sender exited with status {self.proc.popen.poll()}:\n{self.proc.tail()}"

        async def pull() -> bytes:
            client = make_client(channel)
            try:
                into = [torch.empty(int(B) // 2, dtype=torch.bfloat16)]
                request = PullRequest(context_id=B, items=[PullItem(0, "K")], token=self.grant(B))
                await client.pull(self.address, request, into, lambda *a: None, 60)
                return into[0].view(torch.uint8).numpy().tobytes()
            finally:
                await client.close()

        mark = canary(B)
        assert asyncio.run(pull()) == (mark * (int(B) // len(mark) + 1))[:int(B)]


@pytest.mark.parametrize("tls", sorted(TLS))
def test_a_nixl_peer_reads_nothing_outside_its_grant_and_kills_no_sender(services, tls):
    sender = Sender("nixl", tls, services)
    for _ in range(RUNS):
        blind = sender.attack("nixl", "--context", A, "--at", "0x1000")
        assert (blind["agent_info"], blind["granted"], blind["metadata_bytes"], blind["connected"]) == (False, False, 0, False), blind
        scan = sender.attack("nixl", "--context", A, "--token", sender.grant(A), "--scan", str(1 << 20))
        assert scan["granted"] and scan["connected"], scan  # the forged descriptor was loaded
        assert B not in scan["found"], scan
        crash = sender.attack("nixl", "--context", A, "--token", sender.grant(A), "--crash")
        assert crash["granted"] and B not in crash["found"], crash
        sender.assert_alive_and_serving("nixl")


@pytest.mark.parametrize("tls", sorted(TLS))
def test_a_foreign_ucx_endpoint_kills_no_sender(services, tls):
    sender = Sender("ucx", tls, services)
    for _ in range(RUNS):
        blind = sender.attack("ucx", "--context", A)
        assert blind["refused"] and not blind["sender_address"], blind
        wired = sender.attack("ucx", "--context", A, "--token", sender.grant(A), "--hello-from", "ucxx")
        assert wired["sender_address"] and wired["connected"] is True, wired  # the wire-up that killed senders
        sender.assert_alive_and_serving("ucx")
