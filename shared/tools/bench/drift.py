"""`droidmesh bench drift`: the receiver's quality watch under a workload that shifts under it.

On the demo tier's base -> qa pair, on a mesh started here (nats-server, broker, profiler service,
sender `base`, receiver `qa` shadowing every relayed request; logs in `log_dir`):
  1. the profiler service profiles the pair on `before` rows (default `multihop_qa/plain`: there
     full reuse is as good as full prefill) and publishes that config, the one in use;
  2. `n_before` requests over `before` rows, then requests over `after` rows (default
     `multihop_qa/coded`, where full reuse loses the answer) until the receiver has loaded a
     re-profiled config and served `n_settled` requests on it (at most `max_shifted` after the shift).
     The receiver's quality watch raises the alarm (`quality_drift`) and holds the pair on its own
     prefill; re-profiles are published for operators only, so the bench, as the operator, then
     profiles the pair on `after` rows in the profiler service (while requests go on) and the
     receiver loads what it publishes;
  3. per request: the plan, the task score of its answer and of the receiver's own full prefill
     of the same prompt (mode full_prefill), and the shadow's token agreement (receiver log).
Summary: requests from the shift to the drift alarm and to the new config, and per phase (before;
shifted on the old config; held: own prefill after the alarm until the new config; on the
re-profiled config) the mean score of the served answers over the full prefill's.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from droidmesh.shared import report
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.service.localmesh import THREADS, connect_as, start_control_plane, start_sender
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.wire import schemas, subjects

SENDER, RECEIVER = "base", "qa"
PHASES = ("before", "shifted", "held", "reprofiled")
COLUMNS = ["phase", "task", "requests", "plans", "score", "full_prefill_score", "ratio", "agreement"]


def _events(proc: Proc, name: str) -> list[dict[str, Any]]:
    out = []
    for line in list(proc.lines):
        if f'"{name}"' not in line:
            continue
        try:
            ev = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if ev.get("event") == name:
            out.append(ev)
    return out


async def _profile(client: MeshClient, task: str, n: int) -> schemas.RecomputeConfig:
    req = schemas.ProfileRequest(request_id=f"drift-{uuid.uuid4().hex[:8]}", sender_path=SENDER, receiver_path=RECEIVER,
                                 task=task, sender_model=SENDER, receiver_model=RECEIVER, n_train=n, n_test=n,
                                 exhaustive=False, other_tasks=[])
    data = await client.bus.request(subjects.PROFILER_PROFILE, schemas.encode(req), timeout=3600)
    return schemas.decode(data, schemas.ProfileReply).config


async def _stream(access: MeshAccess, receiver: Proc, before: str, after: str, n_before: int, n_settled: int,
                  max_shifted: int, n_profile: int, shape: SuiteShape, say: Callable[[str], None]
                  ) -> tuple[list[dict[str, Any]], dict]:
    # profile requests and prefills are an operator's (admin); the questions a client's
    ops, client = await connect_as(access, "admin", "client")
    records: list[dict[str, Any]] = []
    marks: dict[str, Any] = {}
    try:
        say(f"profiling {SENDER} -> {RECEIVER} on {before} ({n_profile} + {n_profile} rows) in the profiler service")
        t0 = time.perf_counter()
        old = await _profile(ops, before, n_profile)
        marks.update(old_version=old.profile_version, old_plan=old.chosen.plan.groups,
                     profile_s=round(time.perf_counter() - t0, 1))
        await asyncio.to_thread(receiver.wait_for, lambda line: '"config_loaded"' in line
                                and f'"version": {old.profile_version}' in line, 120, "the first profile's config")
        rows = [(before, r) for r in make_rows(before, "test", n_before, shape)]
        rows += [(after, r) for r in make_rows(after, "test", max_shifted, shape)]
        settled_at = None
        reprofile: asyncio.Task[schemas.RecomputeConfig] | None = None
        for i, (task, row) in enumerate(rows):
            spec = task_spec(task)
            await ops.prefill(SENDER, row["context"])
            r = await client.ask(RECEIVER, row["context"], row["input"], max_new_tokens=spec.max_new_tokens, timeout=300)
            ref = await client.ask(RECEIVER, row["context"], row["input"], max_new_tokens=spec.max_new_tokens,
                                   mode="full_prefill", timeout=300)
            loaded = [e for e in _events(receiver, "config_loaded") if e.get("version", 0) > old.profile_version]
            if "drift_at" not in marks and _events(receiver, "quality_drift"):
                marks["drift_at"] = i
                say(f"  alarm after {i + 1} requests: the operator re-profiles {SENDER} -> {RECEIVER} on {after}")
                reprofile = asyncio.create_task(_timed(_profile(ops, after, n_profile), marks))
            if loaded and "reprofiled_at" not in marks:
                marks.update(reprofiled_at=i, new_version=loaded[0]["version"], new_plan=loaded[0].get("chosen"))
            held = "quality_hold" in (r.fallback_reason or "")
            phase = ("before" if i < n_before else "held" if held
                     else "reprofiled" if r.plan != _label(old) and loaded else "shifted")
            records.append({"i": i, "task": task, "phase": phase, "request_id": r.request_id, "plan": r.plan,
                            "path": r.path, "score": score_text(spec, r.text, row["answers"]),
                            "full_prefill_score": score_text(spec, ref.text, row["answers"]), "ttft_ms": r.ttft_ms})
            if i % 10 == 9:
                say(f"  {i + 1} requests ({phase})")
            settled_at = settled_at if settled_at is not None or phase != "reprofiled" else i
            if settled_at is not None and i - settled_at + 1 >= n_settled:
                break
    finally:
        if reprofile is not None and not reprofile.done():
            reprofile.cancel()
        await client.close()
        await ops.close()
    return records, marks


async def _timed(profile: Any, marks: dict[str, Any]) -> schemas.RecomputeConfig:
    """`profile` awaited, its seconds in `marks["reprofile_s"]`."""
    t0 = time.perf_counter()
    cfg = await profile
    marks["reprofile_s"] = round(time.perf_counter() - t0, 1)
    return cfg


def _label(cfg: schemas.RecomputeConfig) -> str:
    from droidmesh.shared.kv.policy import plan_of

    return plan_of(cfg.chosen.plan).label()


def summarize(records: list[dict[str, Any]], agreements: dict[str, float], marks: dict[str, Any],
              n_before: int) -> dict[str, Any]:
    """Per phase: requests, plans served, mean score vs the full prefill's, mean shadow agreement;
    and the shift -> alarm -> new config distances in requests."""
    rows = []
    for phase in PHASES:
        rs = [r for r in records if r["phase"] == phase]
        if not rs:
            continue
        score, ref = statistics.fmean(r["score"] for r in rs), statistics.fmean(r["full_prefill_score"] for r in rs)
        ag = [agreements[r["request_id"]] for r in rs if r["request_id"] in agreements]
        rows.append({"phase": phase, "task": rs[0]["task"], "requests": len(rs),
                     "plans": " ".join(sorted({r["plan"] for r in rs})), "score": round(score, 3),
                     "full_prefill_score": round(ref, 3), "ratio": round(score / ref, 3) if ref else None,
                     "agreement": round(statistics.fmean(ag), 3) if ag else None})
    shift = {k: marks[k] - n_before + 1 for k in ("drift_at", "reprofiled_at") if k in marks}
    return {"rows": rows, "requests_to_alarm": shift.get("drift_at"), "requests_to_new_config": shift.get("reprofiled_at"),
            **{k: v for k, v in marks.items() if k not in ("drift_at", "reprofiled_at")}}


def run_drift(models: dict[str, ModelRef], shape: SuiteShape, log_dir: Path, say: Callable[[str], None], *,
              before: str = "multihop_qa/plain", after: str = "multihop_qa/coded", n_before: int = 40,
              n_settled: int = 40, max_shifted: int = 200, n_profile: int = 8, threshold: float = 0.4,
              window: int = 20) -> dict[str, Any]:
    """Start the mesh, run the sequence of the module docstring, stop it; the summary and records."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        access = start_control_plane([], models, {}, log_dir, procs, roster=Roster.local([SENDER], [RECEIVER]))
        paths = [f"{m}={models[m].path}" for m in (SENDER, RECEIVER)]
        say("starting profiler, sender base and receiver qa (every relayed request shadowed)")
        procs.append(start_service("profiler", {"models": paths}, access.url,
                                   env={**THREADS, **access.env_for("profiler")}, log_dir=log_dir))
        # The profiler declares the pair only once the run is under way: until the sender has
        # read that config, its `readers` setting lets the receiver pull.
        procs.append(start_sender(access, models[SENDER], SENDER, [0, 2, 4], log_dir, THREADS, readers=[RECEIVER]))
        receiver = start_service("receiver", {"model_path": models[RECEIVER].path, "model_id": RECEIVER,
                                              "shadow_share": 1.0, "quality_threshold": threshold,
                                              "quality_window": window}, access.url, name=f"receiver-{RECEIVER}",
                                 env={**THREADS, **access.env_for(receiver_user(RECEIVER))}, log_dir=log_dir)
        procs.append(receiver)
        records, marks = asyncio.run(_stream(access, receiver, before, after, n_before, n_settled, max_shifted,
                                             n_profile, shape, say))
        agreements = {e["request_id"]: e["agreement"] for e in _events(receiver, "shadow")}
        for r in records:
            r["agreement"] = agreements.get(r["request_id"])
        out = summarize(records, agreements, marks, n_before)
        out.update(before=before, after=after, threshold=threshold, window=window, records=records)
        out.setdefault("reprofile_s", None)
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def plot_png(result: dict[str, Any], path: str | Path) -> None:
    """Shadow agreement and answer score per request, with the shift, the alarm and the new config marked."""
    plt = report.pyplot()

    recs = result["records"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = [r["i"] for r in recs if r["agreement"] is not None]
    ax.plot(xs, [r["agreement"] for r in recs if r["agreement"] is not None], ".", ms=4, c="C0", label="shadow agreement")
    win = result["window"]
    ys = [r["agreement"] for r in recs if r["agreement"] is not None]
    ax.plot(xs, [statistics.fmean(ys[max(0, k - win + 1):k + 1]) for k in range(len(ys))], c="C0", lw=1.2,
            label=f"window mean ({win})")
    sc = [statistics.fmean(r["score"] for r in recs[max(0, k - 9):k + 1]) for k in range(len(recs))]
    ref = [statistics.fmean(r["full_prefill_score"] for r in recs[max(0, k - 9):k + 1]) for k in range(len(recs))]
    ax.plot([r["i"] for r in recs], sc, c="C2", lw=1.2, label="served answer score (10-request mean)")
    ax.plot([r["i"] for r in recs], ref, c="0.5", lw=1.0, ls="--", label="own full prefill score")
    ax.axhline(result["threshold"], c="C3", lw=0.8, ls=":", label="alarm threshold")
    n_before = sum(r["phase"] == "before" for r in recs)
    marks = ((n_before - 0.5, f"shift to {result['after']}"), (result.get("requests_to_alarm"), "alarm"),
             (result.get("requests_to_new_config"), "new config"))
    for k, (at, what) in enumerate(marks):
        if at is None:
            continue
        x = at if k == 0 else n_before - 1 + at
        ax.axvline(x, c="k", lw=0.8)
        ax.annotate(what, (x, 1.02 + 0.06 * k), fontsize=7, ha="left", va="bottom", xycoords=("data", "axes fraction"))
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("request")
    ax.set_title(f"quality watch: {SENDER} -> {RECEIVER}, profiled on {result['before']}", fontsize=9, pad=26)
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
