"""Profiler handlers: one function per subject."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.mesh.config_board import validate
from droidmesh.shared.mesh.maps_store import referenced
from droidmesh.shared.model.names import ModelRef, Pair, resolve_model, weights_sha256
from droidmesh.shared.profiling.profile import ProfileSettings, profile_checkpoints
from droidmesh.shared.tasks.jsonl import write_jsonl
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
    if req.rows and not 2 <= len(req.rows) <= s.cfg.max_rows:
        raise BadRequestError(f"{len(req.rows)} rows outside 2..{s.cfg.max_rows} (split in two: train and test)")
    if req.rows and (req.data_train or req.data_test):
        raise BadRequestError("give either rows or data files")
    settings = ProfileSettings(granularity=req.granularity, tolerance=req.tolerance, exhaustive=req.exhaustive)
    t0 = time.perf_counter()
    sender = _model(s, req.sender_path, req.sender_model, req.sender_sha256)
    receiver = _model(s, req.receiver_path, req.receiver_model, req.receiver_sha256)
    maps: dict[str, bytes] = {}  # sha256 -> SCD maps file the config's coded points name
    with tempfile.TemporaryDirectory(prefix="dm-profile-rows-") as tmp:
        data = None
        if req.rows:  # the asker's rows as the JSONL a user would give (`load_rows` splits it in two)
            data = str(Path(tmp) / "rows.jsonl")
            write_jsonl(data, (msgspec.to_builtins(r) for r in req.rows))
        result, cfg = await s.run_torch(
            lambda: profile_checkpoints(sender, receiver, req.task, settings, n_train=req.n_train, n_test=req.n_test,
                                        data=data, data_train=req.data_train, data_test=req.data_test,
                                        version=req.version or None, device=s.cfg.device, dtype=s.cfg.dtype,
                                        other_tasks=req.other_tasks, transfer_search=req.transfer, maps_out=maps))
    if req.relay:  # the relay audit's verdicts outlive a re-profile of the same pair
        cfg = validate(msgspec.structs.replace(cfg, relay=list(req.relay)))
    for sha in sorted(referenced([*cfg.frontier, cfg.chosen])):  # first: a service seeing the config can fetch them
        await s.maps.put(maps[sha])
    await s.board.put(cfg)
    log.info("request", request_id=req.request_id, pair=Pair(cfg.sender_model, cfg.receiver_model).versioned(
             cfg.profile_version), chosen=cfg.chosen.plan.groups, rows=len(req.rows),
             seconds=round(time.perf_counter() - t0, 2))
    return schemas.ProfileReply(request_id=req.request_id, config=cfg, result_json=json.dumps(result))


def _model(s: ProfilerState, path: str, model_id: str, sha256: str) -> ModelRef:
    """A request's model: an id this profiler maps to a checkpoint (`models`), else a path or zoo
    name; when the request names weights (`sha256`), this profiler's must be those."""
    ref = resolve_model(s.cfg.model_paths().get(path, path), name=model_id or None)
    if sha256 and (ref.sha256 or weights_sha256(ref.path)) != sha256:
        raise BadRequestError(f"model {model_id or path}: this profiler's checkpoint {ref.path} has other weights "
                              f"than the {sha256[:12]}... asked for")
    return ref
