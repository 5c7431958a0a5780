"""`droidmesh eval --jobs N`: one eval scored by N worker processes, one torch thread each, in
parts of at most `PART_ROWS` rows, then merged (`evaluation.merge`) into the eval of all its rows.

A part is `eval --shard K/M` of the same row list (rows K, K+M, ...). Each part's file is written
whole as it finishes (`report.write_json`), beside a `run.json` that names the eval; the same
command run again scores only the parts still missing, so a run stopped after hours keeps every
finished part, and parts of another eval in the same folder are refused, not mixed in.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import dataclasses
import functools
import json
import math
import multiprocessing
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from droidmesh.shared import report
from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.tasks.spec import TaskSpec

PART_ROWS = 25  # a part is the work a stopped run can lose: ~10 minutes of a real-tier pair on one core


@dataclasses.dataclass(frozen=True)
class Job:
    """What every part scores: the models (checkpoint paths), where, and `evaluate_pair`'s options."""

    sender: str
    receiver: str
    spec: TaskSpec
    device: str
    dtype: str | None
    wires: tuple[str, ...]
    options: dict[str, Any]  # evaluate_pair keywords: groups, group_sizes, strides, sender_alone, keep_predictions
    stamp: dict[str, Any]  # what names the eval in its JSON (labels, split, data): a part is an `eval --shard K/M`


def wire_makers(names: Sequence[str], sender: Any, receiver: Any) -> dict[str, Callable[[Any], Any]]:
    """name -> plan -> the named wire (`layer_codecs.named_wire`) for this pair's layers and head dim."""
    from droidmesh.shared.profiling import layer_codecs
    from droidmesh.shared.profiling.transfer import Layout

    head_dim, num_layers = Layout.of(sender).head_dim, receiver.num_layers
    return {name: functools.partial(layer_codecs.named_wire, name, num_layers=num_layers, head_dim=head_dim)
            for name in names}


def run(job: Job, rows: Sequence[dict[str, Any]], jobs: int, parts: Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The eval of `rows` by `jobs` processes, parts kept in `parts` (removed once merged);
    ConfigError when `parts` holds another eval's (its `run.json` differs from `fingerprint`)."""
    from droidmesh.shared.tasks.evaluation import merge

    m = min(len(rows), max(jobs, math.ceil(len(rows) / PART_ROWS)))
    named = json.loads(json.dumps({**fingerprint, "parts": m}))  # as run.json reads back (tuples become lists)
    parts.mkdir(parents=True, exist_ok=True)
    kept = parts / "run.json"
    if kept.exists() and json.loads(kept.read_text(encoding="utf-8")) != named or \
            not kept.exists() and any(parts.glob("part-*.json")):
        raise ConfigError(f"{parts} holds parts of another eval (its run.json differs or is missing): "
                          "remove it or run with other options")
    report.write_json(kept, named)
    index = {k: list(range(k, len(rows), m)) for k in range(m)}  # part k: rows k, k + m, ... (`eval --shard k/m`)
    todo = [k for k in range(m) if not _part_path(parts, k, m).exists()]
    done_rows = sum(len(index[k]) for k in range(m) if k not in todo)
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    with tqdm(total=len(rows), initial=done_rows, desc=f"eval {job.spec.name}, {jobs} processes", unit="row") as bar, \
            concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_load, initargs=(job,)) as pool:
        futures = {pool.submit(_score, [rows[i] for i in index[k]], index[k], len(rows), _part_path(parts, k, m)): k
                   for k in todo}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except concurrent.futures.process.BrokenProcessPool:
                raise DroidMeshError(f"a worker process died (out of memory?); the finished parts are kept in "
                                     f"{parts}: run the same command again to score the rest") from None
            bar.update(len(index[futures[future]]))
    ev = merge([json.loads(_part_path(parts, k, m).read_text(encoding="utf-8")) for k in range(m)])
    shutil.rmtree(parts)
    return ev


def _part_path(parts: Path, k: int, m: int) -> Path:
    return parts / f"part-{k}-of-{m}.json"


_WORKER: dict[str, Any] = {}  # one worker process's models and job, loaded once for all its parts


def _load(job: Job) -> None:
    import torch

    from droidmesh.shared.model.adapter import load_model

    torch.set_num_threads(1)  # N processes on N cores, not N x cores threads
    sender = load_model(job.sender, device=job.device, dtype=job.dtype)
    receiver = load_model(job.receiver, device=job.device, dtype=job.dtype)
    _WORKER.update(job=job, sender=sender, receiver=receiver, wires=wire_makers(job.wires, sender, receiver))


def _score(rows: list[dict[str, Any]], index: list[int], total: int, path: Path) -> None:
    from droidmesh.shared.tasks.evaluation import evaluate_pair

    job = _WORKER["job"]
    ev = evaluate_pair(_WORKER["sender"], _WORKER["receiver"], rows, job.spec, progress=False, keep_rows=True,
                       row_index=index, wires=_WORKER["wires"], **job.options)
    ev["per_row"]["of"] = total
    report.write_json(path, {**ev, **job.stamp})
