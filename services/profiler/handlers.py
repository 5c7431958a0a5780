"""Profiler handlers: one function per subject."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import structlog

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.maps_store import referenced
from droidmesh.shared.models import Pair, resolve_model
from droidmesh.shared.profiling.profile import ProfileSettings, profile_checkpoints
from droidmesh.shared.wire import schemas

if TYPE_CHECKING:
    from droidmesh.services.profiler.state import ProfilerState

log = structlog.get_logger("profiler")


async def profile(s: ProfilerState, req: schemas.ProfileRequest) -> schemas.ProfileReply:
    """Profile the pair in the worker thread, publish the config, reply with the full result."""
    for name in ("n_train", "n_test"):
        n = getattr(req, name)
        if not 1 <= n <= s.cfg.max_rows:
            raise BadRequestError(f"{name}={n} outside 1..{s.cfg.max_rows}")
    if req.granularity < 1 or not 0 <= req.tolerance < 1:
        raise BadRequestError("granularity must be >= 1 and tolerance in [0, 1)")
    settings = ProfileSettings(granularity=req.granularity, tolerance=req.tolerance, exhaustive=req.exhaustive)
    t0 = time.perf_counter()
    sender = resolve_model(req.sender_path, name=req.sender_model or None)
    receiver = resolve_model(req.receiver_path, name=req.receiver_model or None)
    maps: dict[str, bytes] = {}  # sha256 -> SCD maps file the config's coded points name
    result, cfg = await s.run_torch(
        lambda: profile_checkpoints(sender, receiver, req.task, settings, n_train=req.n_train, n_test=req.n_test,
                                    data_train=req.data_train, data_test=req.data_test, version=req.version or None,
                                    device=s.cfg.device, dtype=s.cfg.dtype, other_tasks=req.other_tasks,
                                    transfer_search=req.transfer, maps_out=maps))
    for sha in sorted(referenced([*cfg.frontier, cfg.chosen])):  # first: a service seeing the config can fetch them
        await s.maps.put(maps[sha])
    await s.board.put(cfg)
    log.info("request", request_id=req.request_id, pair=Pair(cfg.sender_model, cfg.receiver_model).versioned(
             cfg.profile_version), chosen=cfg.chosen.plan.groups,
             seconds=round(time.perf_counter() - t0, 2))
    return schemas.ProfileReply(request_id=req.request_id, config=cfg, result_json=json.dumps(result))
