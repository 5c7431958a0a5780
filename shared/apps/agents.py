"""`droidmesh agents`: a multi-agent pipeline over the mesh, the workload the relay audit reads.

Every agent is a receiver and a sender: it answers through its model's receiver (reusing what
the mesh holds when the policy says it pays), then hands its output (its prompt and answer) to
its model's sender, which holds and announces it for the agents after it. Per test row of
`multihop_qa` (the demo tier; a context C of ~1K tokens and a question), work passes along NATS
(`dm.agents.<agent>`, one asyncio task per work item in this process):
  planner   on the sender `base`: answers the question over C itself, which captures C and
            announces it (the shared context every later agent may reuse)
  analyst   on `qa`: the question over C, *extending* it (reusable prefix ~1.0, from base); its
            answer is scored against the row's gold answers (token F1)
  verifier  on `qa`: *extends the analyst's output* (~1.0, from qa's own sender: the receiver's
            own weights, so full reuse is exact)
  coder     on `code`: C with its last fifth *rewritten* (after the analyst's answer), ~0.8
  tester    on `code`: extends the coder's output (~1.0, own weights)
  reviewer  on `qa`: C with all but its first 40 % rewritten, mostly *ignoring* it, ~0.4
Each receiver decides per request whether relaying pays (`shared/kv/policy.py`); with
`holdout_share` / `blind_share` / `shadow_share` it randomizes a control and an always-relay arm
and shadows relayed answers, and writes one `request` line per request into `--logs DIR`, which
`droidmesh audit --logs DIR` reads. Rows enter one at a time (`rate` None) or as Poisson
arrivals at `rate` rows per second (`bench load --workload agents`: several rows in flight).
The mesh (nats-server, broker, a sender per model, the `qa` and `code` receivers, the committed
profiles published) is started here and stopped at the end, as `droidmesh demo` does, under the
same per-role NATS users: the pipeline itself (prefills, the planner's generate, the work
subjects) runs as an operator (admin), the agents' questions as a client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import statistics
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from droidmesh.shared.apps.demo import THREADS, connect_as, start_control_plane, start_sender
from droidmesh.shared.bench.output import format_table
from droidmesh.shared.mesh.client import MeshError
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.schemas import RelayBucket
from droidmesh.shared.zoo.suite import SuiteShape, make_rows

TASK = "multihop_qa"


@dataclasses.dataclass(frozen=True)
class Agent:
    name: str
    model: str  # its receiver answers; its sender then holds the output
    after: str | None  # whose output its context extends (None: the planner's context C)
    keep: float  # share of that context's words kept as they are (the rest rewritten)
    question: str | None  # None: the row's own question
    notes: str | None = None  # an earlier agent whose answer is written into the context


AGENTS = (
    Agent("analyst", "qa", None, 1.0, None),
    Agent("verifier", "qa", "analyst", 1.0, " verify who"),
    Agent("coder", "code", None, 0.8, " def answer ( ) :", notes="analyst"),
    Agent("tester", "code", "coder", 1.0, " def test ( ) :"),
    Agent("reviewer", "qa", None, 0.4, " review who"),
)
BY_NAME = {a.name: a for a in AGENTS}
MODELS = ("base", "qa", "code")  # one sender each; receivers for the agents' models
PAIRS = (Pair("base", "qa", TASK), Pair("base", "code", "code_completion"))
COLUMNS = ["rate", "agent", "model", "requests", "ttft_p50_ms", "ttft_p99_ms", "paths", "from", "reused_p50", "quality"]


def rewrite(context: str, keep: float, insert: str = "") -> str:
    """`context` with its first `keep` share of words as they are, then `insert`, then the other
    words reversed: about as long, sharing only the kept prefix."""
    words = context.split(" ")
    n = int(len(words) * keep)
    if n >= len(words):
        return context + insert
    return " ".join(words[:n]) + insert + " " + " ".join(reversed(words[n:]))


def prompt(agent: Agent, work: dict[str, Any]) -> tuple[str, str]:
    """(context, question) `agent` sends for `work` (the row, and the outputs and answers of the
    agents before it)."""
    base = work["outputs"][agent.after] if agent.after else work["context"]
    insert = " note" + work["answers_by"].get(agent.notes, "") if agent.notes else ""
    return rewrite(base, agent.keep, insert), agent.question if agent.question is not None else work["question"]


async def _pipeline(access: MeshAccess, rows: list[dict[str, Any]], say: Callable[[str], None],
                    rate: float | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Run every row through the planner and the agents over NATS subjects; one record per
    receiver request. `rate` None: one row in flight; else Poisson arrivals at `rate` per second."""
    spec = task_spec(TASK)
    ops, client = await connect_as(access, "admin", "client")
    records: list[dict[str, Any]] = []
    done: asyncio.Queue[int | BaseException] = asyncio.Queue()  # a finished row, or what broke a work item
    inbox: dict[str, asyncio.Queue[dict[str, Any]]] = {a.name: asyncio.Queue() for a in AGENTS}
    running: set[asyncio.Task[None]] = set()

    for a in AGENTS:
        await ops.bus.subscribe(subjects.agent_work(a.name), functools.partial(_deliver, inbox[a.name]))

    async def handle(agent: Agent, work: dict[str, Any]) -> None:
        context, question = prompt(agent, work)
        record: dict[str, Any] = {"row": work["row"], "agent": agent.name, "model": agent.model, "rate": rate}
        try:
            r = await client.ask(agent.model, context, question, max_new_tokens=spec.max_new_tokens, timeout=120)
        except (MeshError, TimeoutError) as e:  # counted, and the pipeline goes on
            records.append({**record, "path": "error", "reason": str(e)})
            say(f"  row {work['row'] + 1}: {agent.name} failed: {e}")
            answer, output = "", context + question
        else:
            quality = score_text(spec, r.text, work["answers"]) if agent.name == "analyst" else None
            record.update(path=r.path, plan=r.plan, ttft_ms=r.ttft_ms, predicted_ttft_ms=r.predicted_ttft_ms,
                          sender_model=_sender_model(r.sender_id), reused_tokens=r.reused_tokens,
                          prompt_tokens=r.prompt_tokens, quality=quality, reason=r.fallback_reason)
            answer, output = r.text, context + question + r.text
            try:  # the output is held by the agent's own model's sender before the next agent reads it
                await ops.prefill(agent.model, output, timeout=120)
            except (MeshError, TimeoutError) as e:  # the answer stands; the next agent finds no holder
                record["hold_error"] = str(e)
                say(f"  row {work['row'] + 1}: {agent.name}'s output not held: {e}")
            records.append(record)
        work["answers_by"][agent.name] = answer
        work["outputs"][agent.name] = output
        i = AGENTS.index(agent)
        if i + 1 == len(AGENTS):
            await done.put(work["row"])
        else:
            await ops.bus.publish(subjects.agent_work(AGENTS[i + 1].name), json.dumps(work).encode())

    def finished(task: asyncio.Task[None]) -> None:
        running.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:  # a bug, not a mesh failure: stop the run
            done.put_nowait(failure)

    async def agent_loop(agent: Agent) -> None:
        while True:
            start(handle(agent, await inbox[agent.name].get()))

    async def row_done() -> None:
        got = await asyncio.wait_for(done.get(), 600)
        if isinstance(got, BaseException):
            raise got

    async def plan_row(i: int, row: dict[str, Any]) -> None:
        """The planner: the sender answers over C, capturing it; then the work goes to the first
        agent. A planner that fails ends its row (the agents would find nothing held)."""
        try:
            await ops.sender_generate("base", row["context"], row["input"], max_new_tokens=spec.max_new_tokens)
        except (MeshError, TimeoutError) as e:
            records.append({"row": i, "agent": "planner", "model": "base", "rate": rate, "path": "error",
                            "reason": str(e)})
            say(f"  row {i + 1}: the planner failed: {e}")
            await done.put(i)
            return
        work = {"row": i, "context": row["context"], "question": row["input"], "answers": row["answers"],
                "answers_by": {}, "outputs": {}}
        await ops.bus.publish(subjects.agent_work(AGENTS[0].name), json.dumps(work).encode())

    def start(coro: Coroutine[Any, Any, None]) -> None:
        """A supervised task: cancelled with the run; a bug in it ends the run (through `done`)."""
        task = asyncio.get_running_loop().create_task(coro)
        running.add(task)
        task.add_done_callback(finished)

    tasks = [asyncio.get_running_loop().create_task(agent_loop(a)) for a in AGENTS]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(rows)) if rate else None
    try:
        for i, row in enumerate(rows):
            if gaps is None:
                await plan_row(i, row)
                await row_done()  # one row in flight: the receivers' queues stay light
                say(f"  row {i + 1}/{len(rows)} through the pipeline")
            else:
                start(plan_row(i, row))
                await asyncio.sleep(float(gaps[i]))  # the arrival process itself, not a wait for state
        for _ in rows if gaps is not None else ():
            await row_done()
    finally:
        for t in [*tasks, *running]:
            t.cancel()
        await asyncio.gather(*tasks, *running, return_exceptions=True)
        await client.close()
        await ops.close()
    return records


def _sender_model(sender_id: str | None) -> str | None:
    """The model of a holder's sender id: `<model>` here (`start_sender`), or `<model>-<pid>`
    (a sender's default id)."""
    return sender_id.rsplit("-", 1)[0] if sender_id else None


async def _deliver(queue: asyncio.Queue[dict[str, Any]], data: bytes) -> None:
    await queue.put(json.loads(data))


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arrival rate and agent: requests, TTFT p50 / p99, path mix (failed requests as
    "error"), the holders' models, p50 of the prompt share actually reused, mean quality (the
    analyst's; the others have no reference)."""
    out = []
    for rate in sorted({r.get("rate") for r in records}, key=lambda x: -1.0 if x is None else x):
        for agent in AGENTS:
            mine = [r for r in records if r["agent"] == agent.name and r.get("rate") == rate]
            rs = [r for r in mine if r["path"] != "error"]  # failed requests show in the path mix only
            if not rs:
                continue
            ttft = [r["ttft_ms"] for r in rs]
            scored = [r["quality"] for r in rs if r["quality"] is not None]
            out.append({"rate": "one row" if rate is None else f"{rate:g}/s", "agent": agent.name, "model": agent.model,
                        "requests": len(rs), "ttft_p50_ms": round(statistics.median(ttft), 1),
                        "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1), "paths": _mix(r["path"] for r in mine),
                        "from": _mix(r.get("sender_model") or "-" for r in rs if r["path"] != "full_prefill") or "-",
                        "reused_p50": round(statistics.median(r["reused_tokens"] / max(1, r["prompt_tokens"])
                                                                for r in rs), 3),
                        "quality": round(statistics.fmean(scored), 3) if scored else None})
    return out


def _mix(values: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def demo_tier() -> tuple[dict[str, ModelRef], dict[str, dict[str, Any]]]:
    """The committed demo tier's models and the agents' pairs' saved profiles (`BadRequestError`
    when the tier is not there)."""
    from droidmesh.shared.errors import BadRequestError
    from droidmesh.shared.model.names import tier_models
    from droidmesh.shared.zoo.manifest import REPO_ZOO, profile_file, read_manifest

    root = REPO_ZOO / "demo"
    manifest = read_manifest(root)
    if manifest is None:
        raise BadRequestError(f"no committed demo tier at {root}; run `droidmesh zoo build --tier demo --out {root}`")
    profiles = {p.id: json.loads(profile_file(root, p).read_text()) for p in PAIRS if profile_file(root, p).is_file()}
    return tier_models(root, manifest), profiles


def run_agents(models: dict[str, ModelRef], profiles: dict[str, dict[str, Any]], n_rows: int, shape: SuiteShape,
               log_dir: Path, say: Callable[[str], None], holdout_share: float, shadow_share: float,
               relay: Sequence[RelayBucket] = (), blind_share: float = 0.0, rates: Sequence[float | None] = (None,),
               transport: str = "shm") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start the mesh with its logs in `log_dir` (the pairs' configs carrying the audit's `relay`
    buckets), run `n_rows` rows through the agents at each of `rates` (None: one row in flight;
    else Poisson rows per second), stop it; (summary rows, every request's record). The agents
    share a host, so their bulk channel is `shm` unless `transport` says otherwise."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        receivers = sorted({a.model for a in AGENTS})
        access = start_control_plane(PAIRS, models, profiles, log_dir, procs, relay, Roster.local(MODELS, receivers))
        starts = sorted({profiles[p.id]["chosen"]["start"] for p in PAIRS if p.id in profiles} | {0})
        say(f"starting senders {', '.join(MODELS)}; receivers qa and code")
        for model in MODELS:  # base holds the planner's contexts; qa and code their agents' outputs
            # each grants to its own model's receivers, base also to its pairs' (their configs)
            procs.append(start_sender(access, models[model], model, starts if model == "base" else [0], log_dir, THREADS,
                                      paired=[p.receiver for p in PAIRS if p.sender == model and p.id in profiles],
                                      transport=transport))
        for model in receivers:
            procs.append(start_service("receiver", {"model_path": models[model].path, "model_id": model,
                                                    "holdout_share": holdout_share, "shadow_share": shadow_share,
                                                    "blind_share": blind_share, "transport": transport},
                                       access.url, name=f"receiver-{model}",
                                       env={**THREADS, **access.env_for(receiver_user(model))}, log_dir=log_dir))
        rows = make_rows(TASK, "test", n_rows * len(rates), shape)
        records: list[dict[str, Any]] = []
        for k, rate in enumerate(rates):  # fresh rows per rate: nothing is held from an earlier one
            if rate is not None:
                say(f"rows arriving at {rate:g}/s")
            records += asyncio.run(_pipeline(access, rows[k * n_rows:(k + 1) * n_rows], say, rate, seed=k))
        (log_dir / "agents.json").write_text(json.dumps(records, indent=1))
        return summarize(records), records
    finally:
        for p in reversed(procs):
            p.stop()


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
