"""Profiler handlers: one function per subject."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import structlog

from shared.errors import BadRequestError
from shared.profiling.profile import ProfileSettings, profile_checkpoints
from shared.wire import schemas

if TYPE_CHECKING:
    from services.profiler.service import ProfilerState

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
    result, cfg = await s.run_torch(
        lambda: profile_checkpoints(req.sender_path, req.receiver_path, req.task, settings, n_train=req.n_train,
                                    n_test=req.n_test, data_train=req.data_train, data_test=req.data_test,
                                    sender_model=req.sender_model, receiver_model=req.receiver_model,
                                    version=req.version or None, dtype=s.cfg.dtype, other_tasks=req.other_tasks))
    await s.board.put(cfg)
    log.info("request", request_id=req.request_id, sender=cfg.sender_model, receiver=cfg.receiver_model,
             chosen=[cfg.chosen.start, cfg.chosen.end], version=cfg.profile_version,
             seconds=round(time.perf_counter() - t0, 2))
    return schemas.ProfileReply(request_id=req.request_id, config=cfg, result_json=json.dumps(result))
