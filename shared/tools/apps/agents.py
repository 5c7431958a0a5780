"""`droidmesh agents`: a multi-agent pipeline over the mesh, the workload the relay audit reads.

Every agent is a receiver and a sender: it answers through its model's receiver (reusing what
the mesh holds when the policy says it pays), then hands its output (its prompt and answer) to
its model's sender, which holds and announces it for the agents after it. Per test row of the
tier's task (a context C and a question), work passes along NATS (`dm.agents.<agent>`, one
asyncio task per work item in this process). On the demo tier (`DEMO`: `multihop_qa`, C ~1K
tokens):
  planner   on the sender `base`: answers the question over C itself, which captures C and
            announces it (the shared context every later agent may reuse)
  analyst   on `qa`: the question over C, *extending* it (reusable prefix ~1.0, from base); its
            answer is scored against the row's gold answers (token F1)
  verifier  on `qa`: *extends the analyst's output* (~1.0, from qa's own sender: the receiver's
            own weights, so full reuse is exact)
  coder     on `code`: C with its last fifth *rewritten* (after the analyst's answer), ~0.8
  tester    on `code`: extends the coder's output (~1.0, own weights)
  reviewer  on `qa`: C with all but its first 40 % rewritten, mostly *ignoring* it, ~0.4
The real tier (`REAL`: SmolLM2-135M-Instruct and its LoRA fine-tunes, `doc_qa` rows of ~0.5-1.5K
tokens) runs the same roles: base holds C, `docqa` plays qa's agents, `code` the coder and tester;
the analyst asks the row's own question, the verifier and reviewer short English questions, the
coder and tester Python; each agent's answer budget is its task's (`task_spec`). A tier is data
(`AgentTier`: models, pairs, task, role table), the pipeline one. A pair without a saved profile
runs on a default group (its receiver recomputes the first quarter of its layers; the senders
grant it pulls as a reader), as `droidmesh demo` does; such a receiver takes any model's holder
(`run_agents`), so its reuse may come from another fine-tune's output that starts with C.
Each receiver decides per request whether relaying pays (`shared/kv/policy.py`); with
`holdout_share` / `blind_share` / `shadow_share` it randomizes a control and an always-relay arm
and shadows relayed answers, and writes one `request` line per request into `--logs DIR`, which
`droidmesh audit --logs DIR` reads. Rows enter one at a time (`rate` None) or as Poisson
arrivals at `rate` rows per second (`bench load --workload agents`: several rows in flight).
The mesh (nats-server, broker, a sender per model, the agents' models' receivers, the saved
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

from droidmesh.shared.mesh.client import MeshClient, MeshError
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.report import format_table
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.service.localmesh import THREADS, connect_as, start_control_plane, start_sender
from droidmesh.shared.tasks.scorer import score_text
from droidmesh.shared.tasks.spec import TaskSpec, task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.wire import subjects
from droidmesh.shared.wire.schemas import RelayBucket


@dataclasses.dataclass(frozen=True)
class Agent:
    name: str
    model: str  # its receiver answers; its sender then holds the output
    after: str | None  # whose output its context extends (None: the planner's context C)
    keep: float  # share of that context's words kept as they are (the rest rewritten)
    question: str | None  # None: the row's own question
    notes: str | None = None  # an earlier agent whose answer is written into the context
    task: str | None = None  # whose spec sets its answer budget (None: the tier's task)


@dataclasses.dataclass(frozen=True)
class AgentTier:
    """What the pipeline runs on: a zoo tier's models, the pairs whose saved profiles it publishes,
    the rows' task and the role table (the planner, then `agents` in order)."""

    name: str  # the zoo tier
    task: str  # the rows' task: the planner's and the analyst's question, the analyst's score
    planner: str  # the sender that answers first and holds every row's context C
    models: tuple[str, ...]  # one sender each
    pairs: tuple[Pair, ...]  # planner -> each agent model: a saved profile, else a default group
    agents: tuple[Agent, ...]
    note: str = " note{answer}"  # what the `notes` agent's answer is written into a context as

    @property
    def receivers(self) -> list[str]:
        return sorted({a.model for a in self.agents})

    def spec(self, agent: Agent | None = None) -> TaskSpec:
        """The answer budget's spec of `agent` (None: the planner)."""
        return task_spec(agent.task if agent is not None and agent.task else self.task)


DEMO = AgentTier(
    "demo", "multihop_qa", "base", ("base", "qa", "code"),
    (Pair("base", "qa", "multihop_qa"), Pair("base", "code", "code_completion")),
    (Agent("analyst", "qa", None, 1.0, None),
     Agent("verifier", "qa", "analyst", 1.0, " verify who"),
     Agent("coder", "code", None, 0.8, " def answer ( ) :", notes="analyst"),
     Agent("tester", "code", "coder", 1.0, " def test ( ) :"),
     Agent("reviewer", "qa", None, 0.4, " review who")),
)
CODE_REAL = "code_completion/real"
REAL = AgentTier(
    "real", "doc_qa", "base", ("base", "docqa", "code"),
    (Pair("base", "docqa", "doc_qa"), Pair("base", "code", CODE_REAL)),
    (Agent("analyst", "docqa", None, 1.0, None),
     Agent("verifier", "docqa", "analyst", 1.0, "\n\nQuestion: Is that the right function? Answer yes or no.\nAnswer:"),
     Agent("coder", "code", None, 0.8, "\n\n# An example call of the documented function:\n", notes="analyst",
           task=CODE_REAL),
     Agent("tester", "code", "coder", 1.0, "\n\ndef test_example():\n", task=CODE_REAL),
     Agent("reviewer", "docqa", None, 0.4, "\n\nQuestion: Which module is documented above?\nAnswer:")),
    note=" (the analyst's answer:{answer})",
)
TIERS = {t.name: t for t in (DEMO, REAL)}
# the demo tier's, as before tiers: what tests and `bench load --workload agents` name
TASK, AGENTS, MODELS, PAIRS = DEMO.task, DEMO.agents, DEMO.models, DEMO.pairs
BY_NAME = {a.name: a for a in AGENTS}
COLUMNS = ["rate", "agent", "model", "requests", "ttft_p50_ms", "ttft_p99_ms", "paths", "from", "reused_p50", "quality"]


def rewrite(context: str, keep: float, insert: str = "") -> str:
    """`context` with its first `keep` share of words as they are, then `insert`, then the other
    words reversed: about as long, sharing only the kept prefix."""
    words = context.split(" ")
    n = int(len(words) * keep)
    if n >= len(words):
        return context + insert
    return " ".join(words[:n]) + insert + " " + " ".join(reversed(words[n:]))


def prompt(agent: Agent, work: dict[str, Any], tier: AgentTier = DEMO) -> tuple[str, str]:
    """(context, question) `agent` sends for `work` (the row, and the outputs and answers of the
    agents before it)."""
    base = work["outputs"][agent.after] if agent.after else work["context"]
    insert = tier.note.format(answer=work["answers_by"].get(agent.notes, "")) if agent.notes else ""
    return rewrite(base, agent.keep, insert), agent.question if agent.question is not None else work["question"]


async def _pipeline(access: MeshAccess, rows: list[dict[str, Any]], say: Callable[[str], None],
                    rate: float | None = None, seed: int = 0, tier: AgentTier = DEMO) -> list[dict[str, Any]]:
    """Run every row through the planner and the agents over NATS subjects; one record per
    receiver request. `rate` None: one row in flight; else Poisson arrivals at `rate` per second."""
    ops, client = await connect_as(access, "admin", "client")
    run = _Pipeline(ops, client, say, rate, tier)
    for a in tier.agents:
        await ops.bus.subscribe(subjects.agent_work(a.name), functools.partial(_deliver, run.inbox[a.name]))
    tasks = [asyncio.get_running_loop().create_task(run.agent_loop(a)) for a in tier.agents]
    try:
        await run.feed(rows, seed)
    finally:
        for t in [*tasks, *run.running]:
            t.cancel()
        await asyncio.gather(*tasks, *run.running, return_exceptions=True)
        await client.close()
        await ops.close()
    return run.records


class _Pipeline:
    """One `_pipeline` run on its event loop: the agents' inboxes, the work items in flight (each
    its own task, supervised: a bug in one ends the run through `done`) and the records so far."""

    def __init__(self, ops: MeshClient, client: MeshClient, say: Callable[[str], None], rate: float | None,
                 tier: AgentTier) -> None:
        self.ops, self.client, self.say, self.rate, self.tier = ops, client, say, rate, tier
        self.agents = tier.agents
        self.spec = tier.spec()  # the row's task: the planner's budget, the analyst's score
        self.records: list[dict[str, Any]] = []
        self.done: asyncio.Queue[int | BaseException] = asyncio.Queue()  # a finished row, or what broke a work item
        self.inbox: dict[str, asyncio.Queue[dict[str, Any]]] = {a.name: asyncio.Queue() for a in self.agents}
        self.running: set[asyncio.Task[None]] = set()

    async def feed(self, rows: list[dict[str, Any]], seed: int) -> None:
        """Let the rows in (one at a time, or at Poisson arrivals) and wait until each is through."""
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, len(rows)) if self.rate else None
        for i, row in enumerate(rows):
            if gaps is None:
                await self.plan_row(i, row)
                await self.row_done()  # one row in flight: the receivers' queues stay light
                self.say(f"  row {i + 1}/{len(rows)} through the pipeline")
            else:
                self.start(self.plan_row(i, row))
                await asyncio.sleep(float(gaps[i]))  # the arrival process itself, not a wait for state
        for _ in rows if gaps is not None else ():
            await self.row_done()

    async def handle(self, agent: Agent, work: dict[str, Any]) -> None:
        """`agent`'s turn on a work item: ask, hold the output, hand the work to the next agent."""
        context, question = prompt(agent, work, self.tier)
        answer, output = await self._ask(agent, work, context, question)
        work["answers_by"][agent.name] = answer
        work["outputs"][agent.name] = output
        i = self.agents.index(agent)
        if i + 1 == len(self.agents):
            await self.done.put(work["row"])
        else:
            await self.ops.bus.publish(subjects.agent_work(self.agents[i + 1].name), json.dumps(work).encode())

    async def _ask(self, agent: Agent, work: dict[str, Any], context: str, question: str) -> tuple[str, str]:
        """(answer, output) of `agent`'s request, its record appended; a failed request is recorded
        as an "error" path and answers nothing."""
        record: dict[str, Any] = {"row": work["row"], "agent": agent.name, "model": agent.model, "rate": self.rate}
        try:
            r = await self.client.ask(agent.model, context, question,
                                      max_new_tokens=self.tier.spec(agent).max_new_tokens, timeout=120)
        except (MeshError, TimeoutError) as e:  # counted, and the pipeline goes on
            self.records.append({**record, "path": "error", "reason": str(e)})
            self.say(f"  row {work['row'] + 1}: {agent.name} failed: {e}")
            return "", context + question
        quality = score_text(self.spec, r.text, work["answers"]) if agent.name == "analyst" else None
        record.update(path=r.path, plan=r.plan, ttft_ms=r.ttft_ms, predicted_ttft_ms=r.predicted_ttft_ms,
                      sender_model=_sender_model(r.sender_id), reused_tokens=r.reused_tokens,
                      prompt_tokens=r.prompt_tokens, quality=quality, reason=r.fallback_reason)
        output = context + question + r.text
        try:  # the output is held by the agent's own model's sender before the next agent reads it
            await self.ops.prefill(agent.model, output, timeout=120)
        except (MeshError, TimeoutError) as e:  # the answer stands; the next agent finds no holder
            record["hold_error"] = str(e)
            self.say(f"  row {work['row'] + 1}: {agent.name}'s output not held: {e}")
        self.records.append(record)
        return r.text, output

    def finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:  # a bug, not a mesh failure: stop the run
            self.done.put_nowait(failure)

    async def agent_loop(self, agent: Agent) -> None:
        while True:
            self.start(self.handle(agent, await self.inbox[agent.name].get()))

    async def row_done(self) -> None:
        got = await asyncio.wait_for(self.done.get(), 600)
        if isinstance(got, BaseException):
            raise got

    async def plan_row(self, i: int, row: dict[str, Any]) -> None:
        """The planner: the sender answers over C, capturing it; then the work goes to the first
        agent. A planner that fails ends its row (the agents would find nothing held)."""
        try:
            await self.ops.sender_generate(self.tier.planner, row["context"], row["input"],
                                           max_new_tokens=self.spec.max_new_tokens)
        except (MeshError, TimeoutError) as e:
            self.records.append({"row": i, "agent": "planner", "model": self.tier.planner, "rate": self.rate,
                                 "path": "error", "reason": str(e)})
            self.say(f"  row {i + 1}: the planner failed: {e}")
            await self.done.put(i)
            return
        work = {"row": i, "context": row["context"], "question": row["input"], "answers": row["answers"],
                "answers_by": {}, "outputs": {}}
        await self.ops.bus.publish(subjects.agent_work(self.agents[0].name), json.dumps(work).encode())

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        """A supervised task: cancelled with the run; a bug in it ends the run (through `done`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.running.add(task)
        task.add_done_callback(self.finished)


def _sender_model(sender_id: str | None) -> str | None:
    """The model of a holder's sender id: `<model>` here (`start_sender`), or `<model>-<pid>`
    (a sender's default id)."""
    return sender_id.rsplit("-", 1)[0] if sender_id else None


async def _deliver(queue: asyncio.Queue[dict[str, Any]], data: bytes) -> None:
    await queue.put(json.loads(data))


def summarize(records: list[dict[str, Any]], tier: AgentTier = DEMO) -> list[dict[str, Any]]:
    """Per arrival rate and agent: requests, TTFT p50 / p99, path mix (failed requests as
    "error"), the holders' models, p50 of the prompt share actually reused, mean quality (the
    analyst's; the others have no reference)."""
    out = []
    for rate in sorted({r.get("rate") for r in records}, key=lambda x: -1.0 if x is None else x):
        for agent in tier.agents:
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
    models, profiles, _ = load_tier(DEMO)
    return models, profiles


def load_tier(tier: AgentTier, say: Callable[[str], None] = lambda s: None
              ) -> tuple[dict[str, ModelRef], dict[str, dict[str, Any]], int]:
    """(models, the pairs' saved profiles, the agent models' layer count) of `tier`: the committed
    demo tier (`BadRequestError` when it is not there), or the real tier in its directory, built
    or refreshed first (`build_real`: fetches the base on first use, copies the committed
    adapters and profiles), as `droidmesh demo --tier real` does."""
    from droidmesh.shared.errors import BadRequestError
    from droidmesh.shared.zoo.manifest import REPO_ZOO, read_manifest, servable_profiles, tier_models, zoo_dir

    manifest: dict[str, Any] | None
    if tier.name == "real":
        from droidmesh.shared.zoo.real import build_real

        root = zoo_dir("real")
        manifest = build_real(root, log=say)
    else:
        root = REPO_ZOO / tier.name
        manifest = read_manifest(root)
    if manifest is None:
        raise BadRequestError(f"no committed {tier.name} tier at {root}; "
                              f"run `droidmesh zoo build --tier {tier.name} --out {root}`")
    profiles = servable_profiles(root, tier.pairs, say)
    layers = min(manifest["models"][m]["layers"] for m in tier.receivers)
    return tier_models(root, manifest), profiles, layers


def run_agents(models: dict[str, ModelRef], profiles: dict[str, dict[str, Any]], n_rows: int, shape: SuiteShape,
               log_dir: Path, say: Callable[[str], None], holdout_share: float, shadow_share: float,
               relay: Sequence[RelayBucket] = (), blind_share: float = 0.0, rates: Sequence[float | None] = (None,),
               transport: str = "shm", tier: AgentTier = DEMO, layers: int | None = None,
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start `tier`'s mesh with its logs in `log_dir` (the pairs' configs carrying the audit's
    `relay` buckets), run `n_rows` rows through the agents at each of `rates` (None: one row in
    flight; else Poisson rows per second), stop it; (summary rows, every request's record). The
    agents share a host, so their bulk channel is `shm` unless `transport` says otherwise. A pair
    without a profile in `profiles` runs on the default group of `layers` (the receivers' layer
    count, `load_tier`'s): its receiver recomputes the first quarter of them; with `layers` None
    it has no default group (it prefills). A receiver on a default group reuses any model's
    holder (the broker's longest prefix, the newest on a tie: often another agent's output that
    starts with C), so every sender grants it pulls as a reader."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        receivers = tier.receivers
        access = start_control_plane(tier.pairs, models, profiles, log_dir, procs, relay,
                                     Roster.local(tier.models, receivers))
        default_group = (0, max(1, round(0.25 * layers))) if layers else None
        unprofiled = [p for p in tier.pairs if p.id not in profiles] if default_group else []
        defaulted = sorted({p.receiver for p in unprofiled})
        starts = sorted({profiles[p.id]["chosen"]["start"] for p in tier.pairs if p.id in profiles} | {0})
        say(f"starting senders {', '.join(tier.models)}; receivers {' and '.join(receivers)}"
            + "".join(f"; {p.id}: no saved profile, default group {list(default_group or ())}" for p in unprofiled))
        for model in tier.models:  # the planner's holds its contexts; the others their agents' outputs
            # each grants to its own model's receivers, the planner's also to its pairs' (their configs),
            # every one to the receivers on a default group (readers)
            procs.append(start_sender(access, models[model], model, starts if model == tier.planner else [0], log_dir,
                                      THREADS, transport=transport,
                                      paired=[p.receiver for p in tier.pairs if p.sender == model and p.id in profiles],
                                      readers=[r for r in defaulted if r != model]))
        for model in receivers:
            args: dict[str, object] = {"model_path": models[model].path, "model_id": model,
                                       "holdout_share": holdout_share, "shadow_share": shadow_share,
                                       "blind_share": blind_share, "transport": transport}
            if default_group and model in defaulted:
                args["default_group"] = list(default_group)
            procs.append(start_service("receiver", args, access.url, name=f"receiver-{model}",
                                       env={**THREADS, **access.env_for(receiver_user(model))}, log_dir=log_dir))
        rows = make_rows(tier.task, "test", n_rows * len(rates), shape)
        records: list[dict[str, Any]] = []
        for k, rate in enumerate(rates):  # fresh rows per rate: nothing is held from an earlier one
            if rate is not None:
                say(f"rows arriving at {rate:g}/s")
            records += asyncio.run(_pipeline(access, rows[k * n_rows:(k + 1) * n_rows], say, rate, seed=k, tier=tier))
        (log_dir / "agents.json").write_text(json.dumps(records, indent=1))
        return summarize(records, tier), records
    finally:
        for p in reversed(procs):
            p.stop()


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)
