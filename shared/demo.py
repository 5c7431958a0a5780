"""The main job: a real mesh (nats-server + broker + senders + receivers as processes) serving a
small workload over two zoo pairs, with TTFT and quality per path.

For each pair and each test row: the sender answers its own question over the context (which
captures and announces the context), then the receiver is asked the row's question three ways —
full prefill, full reuse of the sender's KV, and the profiled (or default) partial recompute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.bench.report import format_table
from shared.client import MeshClient
from shared.config_board import NatsConfigBoard
from shared.launch import Proc, start_nats, start_service
from shared.wire import schemas
from shared.zoo import metrics
from shared.zoo.suite import SuiteShape, make_rows, task_spec

PATHS = ("full_prefill", "full_reuse", "auto")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class Pair:
    sender: str
    receiver: str
    task: str
    sender_path: str
    receiver_path: str


def config_from_profile(result: dict[str, Any], version: int) -> schemas.RecomputeConfig:
    """The bucket config of a saved `droidmesh profile` JSON."""

    def point(p: dict[str, Any], q: str = "quality") -> schemas.FrontierPoint:
        return schemas.FrontierPoint(start=p["start"], end=p["end"], recomputed_layers=p["end"] - p["start"],
                                     quality=p[q])

    fit = result.get("latency_fit")
    return schemas.RecomputeConfig(
        sender_model=result["sender"], receiver_model=result["receiver"], profile_version=version,
        task=result["task"], tolerance=result["tolerance"], chosen=point(result["chosen"], "quality_train"),
        frontier=[point(p) for p in result["frontier"]], full_prefill_quality=result["full_prefill"]["quality_train"],
        full_reuse_quality=result["full_reuse"]["quality_train"], total_layers=result["total_layers"],
        latency=schemas.LatencyFit(**fit) if fit else None,
    )


def cut(text: str, stop: str | None) -> str:
    return (text[: text.index(stop)] if stop and stop in text else text).strip()


async def _workload(url: str, pairs: list[Pair], rows: dict[str, list[dict[str, Any]]], say: Callable[[str], None]
                    ) -> list[dict[str, Any]]:
    client = await MeshClient.connect(url)
    out = []
    try:
        for pair in pairs:
            spec = task_spec(pair.task)
            for i, row in enumerate(rows[pair.task]):
                await client.sender_generate(pair.sender, row["context"], row["input"], max_new_tokens=spec.max_new_tokens)
                for mode in PATHS:
                    r = await client.ask(pair.receiver, row["context"], row["input"], mode=mode,
                                         max_new_tokens=spec.max_new_tokens, timeout=120)
                    q = metrics.score(spec.metric, cut(r.text, spec.stop), row["answers"])
                    out.append({"pair": f"{pair.sender}->{pair.receiver}", "task": pair.task, "mode": mode,
                                "path": r.path, "plan": r.plan, "ttft_ms": r.ttft_ms, "quality": q,
                                "bytes_pulled": r.bytes_pulled, "fallback": r.fallback_reason})
                say(f"  {pair.sender}->{pair.receiver}: row {i + 1}/{len(rows[pair.task])} done")
    finally:
        await client.close()
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for pair in dict.fromkeys(r["pair"] for r in records):
        base = statistics.median(r["ttft_ms"] for r in records if r["pair"] == pair and r["mode"] == "full_prefill")
        for mode in PATHS:
            rs = [r for r in records if r["pair"] == pair and r["mode"] == mode]
            ttft = statistics.median(r["ttft_ms"] for r in rs)
            table.append({
                "pair": pair, "task": rs[0]["task"], "path": "/".join(sorted({r["path"] for r in rs})),
                "plan": "/".join(sorted({r["plan"] for r in rs})), "requests": len(rs),
                "ttft_p50_ms": round(ttft, 1), "speedup": round(base / ttft, 2),
                "quality": round(statistics.fmean(r["quality"] for r in rs), 3),
                "MB_pulled": round(statistics.fmean(r["bytes_pulled"] for r in rs) / 1e6, 2),
            })
    return table


def run_demo(pairs: list[Pair], n_rows: int, profiles: dict[tuple[str, str], dict[str, Any]],
             shape: SuiteShape, num_layers: int, say: Callable[[str], None], log_dir: Path | None = None
             ) -> list[dict[str, Any]]:
    """Start the mesh, run the workload, stop everything; return the summary rows."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="droidmesh-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        say(f"starting nats-server (logs in {log_dir})")
        nats, url = start_nats(log_dir=log_dir)
        procs.append(nats)
        asyncio.run(_publish([config_from_profile(p, 1) for p in profiles.values()], url))
        procs.append(start_service("cache_broker", {}, url, env=THREADS, log_dir=log_dir))
        default_group = (0, max(1, round(0.25 * num_layers)))
        for name, path in dict.fromkeys((p.sender, p.sender_path) for p in pairs):
            starts = {pr["chosen"]["start"] for (s, _), pr in profiles.items() if s == name} | {default_group[0]}
            say(f"starting sender {name}")
            procs.append(start_service("sender", {"model_path": path, "model_id": name, "e_layers": sorted(starts)},
                                       url, name=f"sender-{name}", env=THREADS, log_dir=log_dir))
        for pair in pairs:
            args: dict[str, object] = {"model_path": pair.receiver_path, "model_id": pair.receiver}
            if (pair.sender, pair.receiver) not in profiles:
                args["default_group"] = list(default_group)
            say(f"starting receiver {pair.receiver} ({'profiled' if 'default_group' not in args else 'default'} group)")
            procs.append(start_service("receiver", args, url, name=f"receiver-{pair.receiver}", env=THREADS,
                                       log_dir=log_dir))
        rows = {p.task: make_rows(p.task, "test", n_rows, shape) for p in pairs}
        say(f"workload: {n_rows} contexts per pair x {len(PATHS)} paths")
        records = asyncio.run(_workload(url, pairs, rows, say))
        (log_dir / "records.json").write_text(json.dumps(records, indent=1))
        return summarize(records)
    finally:
        for p in reversed(procs):
            p.stop()
        say("mesh stopped")


async def _publish(configs: list[schemas.RecomputeConfig], url: str) -> None:
    if not configs:
        return
    client = await MeshClient.connect(url)
    try:
        board = NatsConfigBoard(client.bus.nc)  # type: ignore[attr-defined]
        for cfg in configs:
            await board.put(cfg)
    finally:
        await client.close()


COLUMNS = ["pair", "task", "path", "plan", "requests", "ttft_p50_ms", "speedup", "quality", "MB_pulled"]


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
