"""Profiler handlers: operators' profiles (`profile`) and receivers' re-profiles (`reprofile`).

Both check the request for who asks (`checks`) before any work, take a place in the queue
(`admission`: refused at once when full), then profile in the worker thread and publish what
passes the test split's rule (`evidence.check_publishable`, the rule `droidmesh config publish`
applies). The published version is the profiler's (`checks.next_version`) unless an operator
named one; a re-profile keeps the relay buckets of the pair's newest config, never a
requester's, and runs only when an operator sent it (`checks.check_reprofiler`): a receiver's
login is refused before any work and its request logged for operators (`reprofile_wanted`)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog

from droidmesh.services.profiler import checks, datafiles
from droidmesh.shared.alarms import alarm
from droidmesh.shared.errors import BadRequestError, UnauthorizedError
from droidmesh.shared.mesh.caller import CALLER
from droidmesh.shared.mesh.config_board import validate
from droidmesh.shared.mesh.maps_store import referenced
from droidmesh.shared.model.names import ModelRef, Pair, weights_sha256
from droidmesh.shared.profiling import evidence
from droidmesh.shared.profiling.profile import profile_checkpoints
from droidmesh.shared.tasks.jsonl import write_jsonl
from droidmesh.shared.wire import schemas
from droidmesh.shared.zoo.manifest import resolve_model

if TYPE_CHECKING:
    from droidmesh.services.profiler.state import ProfilerState

log = structlog.get_logger("profiler")


async def profile(s: ProfilerState, req: schemas.ProfileRequest) -> schemas.ProfileReply:
    """An operator's request (`subjects.PROFILER_PROFILE`)."""
    checks.check_operator(req, s.cfg.max_rows, s.cfg.rows_bytes, time.time())
    async with s.admission.slot(checks.OPERATOR):
        return await _profile(s, checks.OPERATOR, req)


async def reprofile(s: ProfilerState, model_id: str, req: schemas.ProfileRequest) -> schemas.ProfileReply:
    """A re-profile of a pair of `model_id` (`subjects.profiler_reprofile(model_id)`): its
    receivers' (refused, recorded) or an operator's."""
    who = checks.receiver(model_id)
    checks.check_receiver(req, model_id, set(s.cfg.model_paths()), min(s.cfg.max_rows, s.cfg.reprofile_rows),
                          s.cfg.rows_bytes)
    newest = checks.check_paired(s.newest(req.sender_path, model_id), req.sender_path, model_id)
    checks.check_same_rule(newest, req)
    pair = Pair(req.sender_path, model_id)
    caller = CALLER.get()
    try:
        checks.check_reprofiler(caller, pair.id)
    except UnauthorizedError:  # what the quality watch asks for, said where operators look
        alarm("profiler.reprofile", "not_an_operator")
        log.warning("reprofile_wanted", request_id=req.request_id, requester=who.name, user=caller,
                    pair=pair.versioned(newest.profile_version), rows=len(req.rows))
        raise
    async with s.admission.slot(who):
        return await _profile(s, who, req)


async def _profile(s: ProfilerState, who: checks.Requester, req: schemas.ProfileRequest) -> schemas.ProfileReply:
    """Profile the pair in the worker thread, publish the config, reply with the full result."""
    settings = checks.settings(req)
    t0 = time.perf_counter()
    maps: dict[str, bytes] = {}  # sha256 -> SCD maps file the config's coded points name
    with tempfile.TemporaryDirectory(prefix="dm-profile-") as tmp:
        files = datafiles.Staged(other_tasks=[])  # a receiver's: its rows, nothing else
        if who.operator:  # first: a refused file costs no model load
            files = await asyncio.to_thread(datafiles.stage, req, s.cfg.data_root, s.cfg.max_data_bytes, Path(tmp))
        sender = await asyncio.to_thread(_model, s, who, req.sender_path, req.sender_model, req.sender_sha256)
        receiver = await asyncio.to_thread(_model, s, who, req.receiver_path, req.receiver_model, req.receiver_sha256)
        data = None
        if req.rows:  # the asker's rows as the JSONL a user would give (`load_rows` splits it in two)
            data = str(Path(tmp) / "rows.jsonl")
            write_jsonl(data, (msgspec.to_builtins(r) for r in req.rows))
        result, cfg = await s.run_torch(
            lambda: profile_checkpoints(sender, receiver, req.task, settings, n_train=req.n_train, n_test=req.n_test,
                                        data=data, data_train=files.data_train, data_test=files.data_test,
                                        device=s.cfg.device, dtype=s.cfg.dtype, other_tasks=files.other_tasks,
                                        transfer_search=req.transfer, maps_out=maps))
    try:
        evidence.check_publishable(cfg, f"{cfg.sender_model} -> {cfg.receiver_model}",
                                   "not published (the receivers keep the pair's current config)")
    except BadRequestError:  # what the profile found stays in the log; the requester gets the one-line reason
        log.warning("profile_not_published", request_id=req.request_id, requester=who.name,
                    pair=Pair(cfg.sender_model, cfg.receiver_model).id, chosen=cfg.chosen.plan.groups,
                    test_verdict=cfg.test_verdict, test_interval=cfg.test_interval, test_rows=cfg.test_rows)
        raise
    newest = s.newest(cfg.sender_model, cfg.receiver_model)
    version = req.version or checks.next_version(newest.profile_version if newest else None, time.time())
    # the relay audit's verdicts outlive a re-profile of the same pair; only an operator sets others
    relay = list(req.relay) if who.operator else list(newest.relay) if newest else []
    cfg = validate(msgspec.structs.replace(cfg, profile_version=version, relay=relay))
    for sha in sorted(referenced([*cfg.frontier, cfg.chosen])):  # first: a service seeing the config can fetch them
        await s.maps.put(maps[sha])
    await s.board.put(cfg)
    s.keep(cfg)
    log.info("request", request_id=req.request_id, requester=who.name, pair=Pair(cfg.sender_model, cfg.receiver_model)
             .versioned(cfg.profile_version), chosen=cfg.chosen.plan.groups, rows=len(req.rows),
             seconds=round(time.perf_counter() - t0, 2))
    return schemas.ProfileReply(request_id=req.request_id, config=cfg, result_json=json.dumps(result))


def _model(s: ProfilerState, who: checks.Requester, path: str, model_id: str, sha256: str) -> ModelRef:
    """A request's model. An operator's: an id this profiler maps to a checkpoint (`models`), else
    a path or zoo name. A receiver's: a mapped id only (checked before), published under that id.
    When the request names weights (`sha256`), this profiler's must be those."""
    mapped = s.cfg.model_paths()
    if who.operator:
        ref = resolve_model(mapped.get(path, path), name=model_id or None)
    else:
        ref = resolve_model(mapped[path], name=path)
    if sha256 and (ref.sha256 or weights_sha256(ref.path)) != sha256:
        raise BadRequestError(f"model {model_id or path}: this profiler's checkpoint has other weights than the "
                              f"{sha256[:12]}... asked for")
    return ref
