"""A withdrawn pair config stops being in force without a restart: on a real nats-server under a
rendered roster (per-role users), with a broker, a sender and a receiver as processes, deleting a
version's key (`nats kv del`) brings the running receiver back to the version left, and
`droidmesh config delete` of the pair brings it back to its default (full prefill here), while
the sender refuses the pair's receivers their next pull grant."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import nats
import pytest
from click.testing import CliRunner

from droidmesh.shared.errors import TransferError
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.config_board import config_key
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import start_secure_nats
from droidmesh.shared.service.localmesh import THREADS, publish_configs
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.transport.pull import request_grant, requester
from droidmesh.shared.wire import schemas, subjects
from tests.system.conftest import start_together, words

pytestmark = [pytest.mark.system, pytest.mark.security]

ROSTER = Roster.local(["summ"], ["qa"])  # sender id summ; the receivers of qa (not in the sender's readers)
SECONDS = 60  # deadline of each wait for a log line: the services react within seconds


def _config(tiny_pair, version: int, groups: list[tuple[int, int]]) -> schemas.RecomputeConfig:
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=groups), sum(e - s for s, e in groups), 0.99)
    return schemas.RecomputeConfig(
        sender_model="summ", receiver_model="qa", sender_sha256=weights_sha256(tiny_pair[0]),
        receiver_sha256=weights_sha256(tiny_pair[1]), profile_version=version, task="test", tolerance=0.05,
        chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6,
        created_at=time.time())


def _logged(event: str, **fields: object) -> Callable[[str], bool]:
    def match(line: str) -> bool:
        if not (line.startswith("{") and f'"{event}"' in line):
            return False
        rec = json.loads(line)
        return rec.get("event") == event and all(rec.get(k) == v for k, v in fields.items())
    return match


async def _prefill_held(access: MeshAccess, ops: MeshClient, context: str) -> schemas.CacheAvailable:
    """The operator has the sender cache `context`; its availability event (what a lookup returns)."""
    nc = await nats.connect(access.url, **access.options("admin"))
    seen: asyncio.Queue[schemas.CacheAvailable] = asyncio.Queue()

    async def on_available(msg) -> None:
        await seen.put(schemas.decode(msg.data, schemas.CacheAvailable))

    try:
        await nc.subscribe(subjects.cache_available("summ"), cb=on_available)
        await nc.flush()
        reply = await ops.prefill("summ", context)
        async with asyncio.timeout(SECONDS):
            while (ev := await seen.get()).context_id != reply.context_id:
                pass
        return ev
    finally:
        await nc.close()


async def _grant(access: MeshAccess, ev: schemas.CacheAvailable) -> str:
    """A grant for `ev` asked as the receivers of qa ask: the grant, or "refused: <why>"."""
    nc = await nats.connect(access.url, **access.options(receiver_user("qa")))
    try:
        return await request_grant(requester(nc), ev, 10)
    except TransferError as e:
        return f"refused: {e}"
    finally:
        await nc.close()


async def _until_plan(ops: MeshClient, plan: str, offset: int, tries: int = 40) -> schemas.GenerateReply:
    """Fresh contexts prefilled then asked over until a reply ran `plan` (the sender captures a
    new context with the E layers of the configs it holds); the last reply."""
    reply = None
    for i in range(tries):
        context = words(160 + i, offset=offset)
        await ops.prefill("summ", context)
        reply = await ops.ask("qa", context, " q", max_new_tokens=2)
        if reply.plan == plan:
            break
    assert reply is not None
    return reply


@pytest.fixture
def access() -> Iterator[MeshAccess]:
    """nats-server under ROSTER; stopped after the services (a test's `services` come after it)."""
    proc, access = start_secure_nats(ROSTER)
    try:
        yield access
    finally:
        proc.stop()


def test_a_withdrawn_config_leaves_the_running_receiver_and_the_sender_revokes_the_pair(tiny_pair, access, services):
    """Versions 1 ([2,4)) and 2 ([1,5)) of summ -> qa; the receiver runs version 2. `nats kv del`
    of version 2: it runs version 1. `droidmesh config delete` of the pair: it runs full prefill
    (reason: no recompute config), and the sender, whose readers do not list qa, refuses a grant
    to the receivers of qa that it gave while the pair had a config."""
    v1, v2 = _config(tiny_pair, 1, [(2, 4)]), _config(tiny_pair, 2, [(1, 5)])
    asyncio.run(publish_configs([v1, v2], access))  # as the profiler: the bucket exists before the services read it
    _, sender, receiver = start_together(access.url, [
        ("cache_broker", {}, {"env": {**THREADS, **access.env_for("broker")}}),
        ("sender", {"model_path": tiny_pair[0], "model_id": "summ", "sender_id": "summ", "e_layers": [0]},
         {"env": {**THREADS, **access.env_for(sender_user("summ"))}}),
        ("receiver", {"model_path": tiny_pair[1], "model_id": "qa"},
         {"env": {**THREADS, **access.env_for(receiver_user("qa"))}}),
    ], services)
    sender.wait_for(_logged("reader_paired", receiver_model="qa"), SECONDS, "the pair declared")
    receiver.wait_for(_logged("config_loaded", version=2), SECONDS, "version 2 loaded")

    async def run() -> dict[str, object]:
        ops = await MeshClient.connect(access.url, **access.options("admin"))
        try:
            out: dict[str, object] = {"v2": await _until_plan(ops, "recompute [1,5)", offset=1)}
            ev = await _prefill_held(access, ops, words(90, offset=5))
            out["grant_paired"] = await _grant(access, ev)
            kv = await ops.bus.nc.jetstream().key_value(subjects.CONFIG_BUCKET)
            await kv.delete(config_key(v2))  # what `nats kv del` does: the key's DEL marker
            await asyncio.to_thread(receiver.wait_for, _logged("config_withdrawn", version=2, now_version=1), SECONDS,
                                    "version 2 withdrawn")
            out["v1"] = await _until_plan(ops, "recompute [2,4)", offset=2)
            out["cli"] = await asyncio.to_thread(  # the command runs its own event loop
                CliRunner().invoke, main, ["config", "delete", "--sender", "summ", "--receiver", "qa", "--nats", access.url,
                                           "--user", "admin", "--password", access.password("admin")], env={"DM_DEBUG": ""})
            await asyncio.to_thread(receiver.wait_for, _logged("config_withdrawn", version=1, now_version=None),
                                    SECONDS, "the pair withdrawn")
            await asyncio.to_thread(sender.wait_for, _logged("reader_unpaired", receiver_model="qa"), SECONDS,
                                    "the pair revoked")
            context = words(200, offset=3)
            await ops.prefill("summ", context)
            out["none"] = await ops.ask("qa", context, " q", max_new_tokens=2)
            out["grant_unpaired"] = await _grant(access, ev)
            return out
        finally:
            await ops.close()

    out = asyncio.run(run())
    assert (out["v2"].path, out["v2"].plan) == ("partial", "recompute [1,5)"), out["v2"]
    assert (out["v1"].path, out["v1"].plan) == ("partial", "recompute [2,4)"), out["v1"]
    assert out["cli"].exit_code == 0 and out["cli"].stdout.strip() == \
        f"withdrew {config_key(v1)} from {subjects.CONFIG_BUCKET}", (out["cli"].stdout, out["cli"].stderr)
    assert out["none"].path == "full_prefill" and "no recompute config" in (out["none"].fallback_reason or ""), out["none"]
    assert not str(out["grant_paired"]).startswith("refused"), out["grant_paired"]
    assert str(out["grant_unpaired"]).startswith("refused") and "unauthorized" in str(out["grant_unpaired"]), \
        out["grant_unpaired"]
