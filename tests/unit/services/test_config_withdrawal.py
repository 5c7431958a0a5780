"""A pair config withdrawn from the board (a delete or purge of its key) is dropped by whoever
watches it: the board hands the withdrawn config and what is left, a sender's holder unpairs the
receiver model (its next grant is refused), a receiver falls back to the newest version left or
to its default, and the profiler forgets the pair. In one process: in-memory board and bus."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import msgspec
import pytest
import torch

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.service import ReceiverService
from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.service import SenderService
from droidmesh.shared.errors import UnauthorizedError
from droidmesh.shared.holding import grants
from droidmesh.shared.holding.holder import Holder
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.mesh.bus import InProcessBus
from droidmesh.shared.mesh.config_board import InMemoryConfigBoard, config_key
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateRequest

CONTEXT = " ".join(["alpha beta gamma delta"] * 12)
DEADLINE_S = 30.0


def _config(sender: str, receiver: str, version: int, groups: list[tuple[int, int]], **fields) -> schemas.RecomputeConfig:
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=groups), sum(e - s for s, e in groups), 0.99)
    base = dict(sender_model=sender, receiver_model=receiver, sender_sha256="a" * 64, receiver_sha256="b" * 64,
                profile_version=version, task="t", tolerance=0.05, chosen=point, frontier=[point],
                full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6, created_at=time.time())
    return schemas.RecomputeConfig(**{**base, **fields})


async def _until(done: Callable[[], bool], what: str) -> None:
    """Yield to the loop until `done()`; the board's watch runs as its own task."""
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.005)


def test_the_board_hands_each_withdrawn_config_with_what_is_left():
    """Two versions of one pair and another pair: deleting one version withdraws it (the other
    version and pair left); deleting the pair withdraws what is left of it, oldest first; a pair
    with nothing on the board deletes nothing."""
    v1, v2, other = _config("s", "r", 1, [(2, 4)]), _config("s", "r", 2, [(0, 2)]), _config("s", "q", 1, [(2, 4)])
    seen: list[str] = []
    withdrawn: list[tuple[str, list[str]]] = []

    async def on_config(cfg: schemas.RecomputeConfig) -> None:
        seen.append(config_key(cfg))

    async def on_withdrawn(cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
        withdrawn.append((config_key(cfg), sorted(config_key(c) for c in left)))

    async def run() -> list[list[str]]:
        board = InMemoryConfigBoard()
        for cfg in (v1, v2, other):
            await board.put(cfg)
        watch = asyncio.create_task(board.watch(on_config, on_withdrawn))
        try:
            await _until(lambda: len(seen) == 3, "the three configs seen")
            deleted = [await board.delete("s", "r", version=2)]
            await _until(lambda: len(withdrawn) == 1, "version 2 withdrawn")
            deleted += [await board.delete("s", "r"), await board.delete("s", "r"), await board.delete("x", "r")]
            await _until(lambda: len(withdrawn) == 2, "version 1 withdrawn")
            return deleted
        finally:
            watch.cancel()

    deleted = asyncio.run(run())
    assert deleted == [["s-to-r.v2"], ["s-to-r.v1"], [], []]
    assert withdrawn == [("s-to-r.v2", ["s-to-q.v1", "s-to-r.v1"]), ("s-to-r.v1", ["s-to-q.v1"])]


def test_a_withdrawn_pair_is_unpaired_and_its_receivers_next_grant_refused():
    """The holder pairs `paired` from its config and keeps E for its plans; once no config names
    the pair, a grant to the receivers of `paired` is refused and its E layers are dropped, while a
    pair with a config left keeps both."""
    holder = Holder("s1", InProcessBus(), CacheStore(1 << 20), Metrics("sender"), grant_ttl_s=10.0, heartbeat_s=1.0,
                    authenticated=True)
    held = holder.add_model("summ", "a" * 64, torch.float32)
    paired, kept = _config("summ", "paired", 1, [(2, 4)]), _config("summ", "kept", 1, [(1, 3)])
    holder.on_config(paired)
    holder.on_config(kept)
    inbox = f"{subjects.inbox_prefix('receiver-paired')}.Zx81kQp2.7"
    grants.check(held.readers, inbox, authenticated=True)
    grants.unpair_withdrawn(holder, [kept])
    with pytest.raises(UnauthorizedError, match="the receivers of paired may not read summ's contexts"):
        grants.check(held.readers, inbox, authenticated=True)
    grants.check(held.readers, f"{subjects.inbox_prefix('receiver-kept')}.Zx81kQp2.7", authenticated=True)
    assert held.profiled_e == {"kept": {1}}


@contextlib.asynccontextmanager
async def _mesh(tiny_pair, tiny_models):
    bus, board = InProcessBus(), InMemoryConfigBoard()
    scfg = SenderConfig(model_path=str(tiny_pair[0]), model_id="sender", e_layers=(0, 2), heartbeat_s=0.2,
                        transport="inproc")
    rcfg = ReceiverConfig(model_path=str(tiny_pair[1]), model_id="receiver", default_group=(), transport="inproc",
                          hold=False)
    async with BrokerService(BrokerConfig(), bus=bus), \
            SenderService(scfg, bus=bus, model=tiny_models[0], board=board) as sender, \
            ReceiverService(rcfg, bus=bus, model=tiny_models[1], board=board) as receiver:
        yield bus, board, sender, receiver


async def _generate(bus, request_id: str) -> schemas.GenerateReply:
    req = GenerateRequest(request_id=request_id, context=CONTEXT, question=" what is gamma", max_new_tokens=2)
    return schemas.decode(await bus.request(subjects.receiver_generate("receiver"), schemas.encode(req), timeout=30),
                          schemas.GenerateReply)


def test_a_running_receiver_falls_back_to_the_version_left_then_to_its_default(tiny_pair, tiny_models):
    """Versions 1 ([2,4)) and 2 ([0,2)) of the pair: the receiver runs version 2; version 2
    withdrawn, it runs version 1; the pair withdrawn, it runs full prefill (no default group),
    reason no recompute config, and the sender no longer pairs the receiver model."""
    shas = dict(sender_sha256=weights_sha256(tiny_pair[0]), receiver_sha256=weights_sha256(tiny_pair[1]))
    v1 = _config("sender", "receiver", 1, [(2, 4)], **shas)
    v2 = _config("sender", "receiver", 2, [(0, 2)], **shas)

    async def run() -> tuple[list[schemas.GenerateReply], bool]:
        async with _mesh(tiny_pair, tiny_models) as (bus, board, sender, receiver):
            configs = receiver.state.configs
            await board.put(v1)
            await board.put(v2)
            await _until(lambda: configs.get("sender") == v2, "version 2 loaded")
            await bus.request(subjects.sender_prefill("sender"), schemas.encode(
                schemas.PrefillRequest(request_id="p", context=CONTEXT)), timeout=30)
            await bus.settle()
            replies = [await _generate(bus, "r2")]
            await board.delete("sender", "receiver", version=2)
            await _until(lambda: configs.get("sender") == v1, "version 1 in force again")
            replies.append(await _generate(bus, "r1"))
            await board.delete("sender", "receiver")
            await _until(lambda: "sender" not in configs, "the pair's plan dropped")
            replies.append(await _generate(bus, "r0"))
            return replies, sender.state.held.readers.allows("receiver")

    replies, still_paired = asyncio.run(run())
    assert [(r.path, r.plan) for r in replies[:2]] == [("partial", "recompute [0,2)"), ("partial", "recompute [2,4)")]
    assert replies[2].path == "full_prefill" and "no recompute config" in (replies[2].fallback_reason or ""), replies[2]
    assert not still_paired


def test_the_profiler_forgets_a_withdrawn_pair_and_keeps_the_newest_left():
    from droidmesh.services.profiler.config import ProfilerConfig
    from droidmesh.services.profiler.state import ProfilerState
    from droidmesh.shared.mesh.maps_store import InMemoryMapsStore

    async def torch_thread(fn, *args):
        return fn(*args)

    state = ProfilerState(ProfilerConfig(), InMemoryConfigBoard(), InMemoryMapsStore(), torch_thread)
    v1, v2 = _config("s", "r", 1, [(2, 4)]), _config("s", "r", 2, [(0, 2)])
    state.keep(v1)
    state.keep(v2)
    state.forget(v1, [v2])  # an older version: the newest stands
    assert state.newest("s", "r") == v2
    state.keep(v1)
    state.forget(v2, [v1])  # the newest: the one left takes its place
    assert state.newest("s", "r") == v1
    state.forget(v1, [msgspec.structs.replace(v1, receiver_model="q")])  # only another pair's left
    assert state.newest("s", "r") is None
