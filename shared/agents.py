"""`droidmesh agents`: a multi-agent pipeline over the mesh, the workload the relay audit reads.

Per test row of `multihop_qa` (the demo tier; a context C of ~1K tokens and a question), four
agents pass work along NATS (`dm.agents.<agent>`, one asyncio task each in this process):
  planner   on the sender `base`: answers the question over C itself, which captures C and
            announces it (the shared context every later agent may reuse)
  analyst   on the receiver `qa`: the question over C, *extending* it (reusable prefix ~1.0);
            its answer is scored against the row's gold answers (token F1)
  coder     on the receiver `code`: C with its last fifth *rewritten* (after the analyst's answer),
            reusable prefix ~0.8
  reviewer  on the receiver `qa`: C with all but its first 40 % rewritten, mostly *ignoring* the
            context, reusable prefix ~0.4
Each receiver decides per request whether relaying pays (`shared/kv/policy.py`); with
`holdout_share` / `blind_share` / `shadow_share` it randomizes a control and an always-relay arm
and shadows relayed answers, and writes
one `request` line per request into `--logs DIR`, which `droidmesh audit --logs DIR` reads.
The mesh (nats-server, broker, the `base` sender, the `qa` and `code` receivers, the committed
profiles published) is started here and stopped at the end, as `droidmesh demo` does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from droidmesh.shared.bench.report import format_table
from droidmesh.shared.client import MeshClient, MeshError
from droidmesh.shared.demo import THREADS, start_control_plane
from droidmesh.shared.launch import Proc, start_service
from droidmesh.shared.models import ModelRef, Pair
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.schemas import RelayBucket
from droidmesh.shared.zoo.suite import SuiteShape, make_rows

TASK = "multihop_qa"
AGENTS = ("analyst", "coder", "reviewer")  # the receivers' agents, in pipeline order
RECEIVER_OF = {"analyst": "qa", "coder": "code", "reviewer": "qa"}
PAIRS = (Pair("base", "qa", TASK), Pair("base", "code", "code_completion"))
COLUMNS = ["agent", "model", "requests", "ttft_p50_ms", "paths", "reused_p50", "quality"]


def prompts(context: str, question: str, analyst_answer: str) -> dict[str, tuple[str, str]]:
    """(context, question) each receiver agent sends for one row, all about as long as C: the
    analyst extends C; the coder keeps its first 80 % and rewrites the rest (its words reversed,
    after the analyst's answer); the reviewer keeps 40 % and rewrites the rest the same way."""
    words = context.split(" ")

    def rewrite(keep: float, insert: str = "") -> str:
        n = int(len(words) * keep)
        return " ".join(words[:n]) + insert + " " + " ".join(reversed(words[n:]))

    return {
        "analyst": (context, question),
        "coder": (rewrite(0.8, " note" + analyst_answer), " def answer ( ) :"),
        "reviewer": (rewrite(0.4), " review who"),
    }


async def _pipeline(url: str, rows: list[dict[str, Any]], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every row through planner -> analyst -> coder -> reviewer over NATS subjects; return
    one record per receiver request."""
    spec = task_spec(TASK)
    client = await MeshClient.connect(url)
    records: list[dict[str, Any]] = []
    done: asyncio.Queue[int] = asyncio.Queue()
    inbox: dict[str, asyncio.Queue[dict[str, Any]]] = {a: asyncio.Queue() for a in AGENTS}

    for agent in AGENTS:
        await client.bus.subscribe(subjects.agent_work(agent), functools.partial(_deliver, inbox[agent]))

    async def agent_loop(agent: str) -> None:
        nxt = AGENTS[AGENTS.index(agent) + 1] if agent != AGENTS[-1] else None
        while True:
            work = await inbox[agent].get()
            context, question = work["prompts"][agent]
            try:
                r = await client.ask(RECEIVER_OF[agent], context, question, max_new_tokens=spec.max_new_tokens,
                                     timeout=120)
            except (MeshError, TimeoutError) as e:  # counted, and the pipeline goes on
                records.append({"row": work["row"], "agent": agent, "model": RECEIVER_OF[agent], "path": "error",
                                "reason": str(e)})
                say(f"  row {work['row'] + 1}: {agent} failed: {e}")
                answer = ""
            else:
                quality = score_text(spec, r.text, work["answers"]) if agent == "analyst" else None
                records.append({"row": work["row"], "agent": agent, "model": RECEIVER_OF[agent], "path": r.path,
                                "plan": r.plan, "ttft_ms": r.ttft_ms, "predicted_ttft_ms": r.predicted_ttft_ms,
                                "reused_tokens": r.reused_tokens, "prompt_tokens": r.prompt_tokens, "quality": quality,
                                "reason": r.fallback_reason})
                answer = r.text
            if agent == "analyst":  # the coder's prompt carries the analyst's answer
                work["prompts"] = prompts(work["context"], work["question"], answer)
            if nxt is None:
                await done.put(work["row"])
            else:
                await client.bus.publish(subjects.agent_work(nxt), json.dumps(work).encode())

    tasks = [asyncio.get_running_loop().create_task(agent_loop(a)) for a in AGENTS]
    try:
        for i, row in enumerate(rows):  # the planner: the sender answers over C, capturing it
            await client.sender_generate("base", row["context"], row["input"], max_new_tokens=spec.max_new_tokens)
            work = {"row": i, "context": row["context"], "question": row["input"], "answers": row["answers"],
                    "prompts": prompts(row["context"], row["input"], "")}
            await client.bus.publish(subjects.agent_work(AGENTS[0]), json.dumps(work).encode())
            await asyncio.wait_for(done.get(), 600)  # one row in flight: the receivers' queues stay light
            say(f"  row {i + 1}/{len(rows)} through the pipeline")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return records


async def _deliver(queue: asyncio.Queue[dict[str, Any]], data: bytes) -> None:
    await queue.put(json.loads(data))


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent: requests, TTFT p50, path mix (failed requests as "error"), p50 of the prompt
    share actually reused, mean quality (the analyst's; the others have no reference)."""
    out = []
    for agent in AGENTS:
        mine = [r for r in records if r["agent"] == agent]
        rs = [r for r in mine if r["path"] != "error"]  # failed requests show in the path mix only
        if not rs:
            continue
        paths: dict[str, int] = {}
        for r in mine:
            paths[r["path"]] = paths.get(r["path"], 0) + 1
        scored = [r["quality"] for r in rs if r["quality"] is not None]
        out.append({"agent": agent, "model": rs[0]["model"], "requests": len(rs),
                    "ttft_p50_ms": round(statistics.median(r["ttft_ms"] for r in rs), 1),
                    "paths": " ".join(f"{k}:{v}" for k, v in sorted(paths.items())),
                    "reused_p50": round(statistics.median(r["reused_tokens"] / max(1, r["prompt_tokens"])
                                                            for r in rs), 3),
                    "quality": round(statistics.fmean(scored), 3) if scored else None})
    return out


def run_agents(models: dict[str, ModelRef], profiles: dict[str, dict[str, Any]], n_rows: int, shape: SuiteShape,
               log_dir: Path, say: Callable[[str], None], holdout_share: float, shadow_share: float,
               relay: Sequence[RelayBucket] = (), blind_share: float = 0.0,
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start the mesh with its logs in `log_dir` (the pairs' configs carrying the audit's `relay`
    buckets), run `n_rows` rows through the agents, stop it; (summary rows, every request's record)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        url = start_control_plane(PAIRS, models, profiles, log_dir, procs, relay)
        starts = sorted({profiles[p.id]["chosen"]["start"] for p in PAIRS if p.id in profiles} | {0})
        say("starting sender base, receivers qa and code")
        procs.append(start_service("sender", {"model_path": models["base"].path, "model_id": "base",
                                              "e_layers": starts}, url, name="sender-base", env=THREADS,
                                   log_dir=log_dir))
        for model in ("qa", "code"):
            procs.append(start_service("receiver", {"model_path": models[model].path, "model_id": model,
                                                    "holdout_share": holdout_share, "shadow_share": shadow_share,
                                                    "blind_share": blind_share},
                                       url, name=f"receiver-{model}", env=THREADS, log_dir=log_dir))
        records = asyncio.run(_pipeline(url, make_rows(TASK, "test", n_rows, shape), say))
        (log_dir / "agents.json").write_text(json.dumps(records, indent=1))
        return summarize(records), records
    finally:
        for p in reversed(procs):
            p.stop()


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
