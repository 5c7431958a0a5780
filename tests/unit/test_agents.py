"""The agents workload's prompts: extend, rewrite, ignore, at the intended reusable fractions, on
the demo tier and the real one; answer budgets; pairs without a saved profile."""

from __future__ import annotations

from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.tasks.suite import SuiteShape
from droidmesh.shared.tools.apps.agents import AGENTS, BY_NAME, DEMO, REAL, prompt, summarize
from droidmesh.shared.wire.hashing import common_prefix

CONTEXT = " ".join(f"w{i}" for i in range(100))


def _work() -> dict:
    return {"row": 0, "context": CONTEXT, "question": " q", "answers": ["a"], "answers_by": {}, "outputs": {}}


def test_each_agent_reuses_its_intended_share_of_what_it_builds_on():
    """Analyst all of C, verifier all of the analyst's output, coder C's first 80 words, tester all
    of the coder's output, reviewer C's first 40; each context is about as long as what it builds on."""
    work = _work()
    shared, lengths = {}, {}
    for agent in AGENTS:
        context, question = prompt(agent, work)
        source = (work["outputs"][agent.after] if agent.after else CONTEXT).split(" ")
        shared[agent.name] = common_prefix(source, context.split(" ")) / len(source)
        lengths[agent.name] = len(context.split(" ")) - len(source)
        work["answers_by"][agent.name] = f" ans{agent.name}"
        work["outputs"][agent.name] = context + question + work["answers_by"][agent.name]
    assert shared == {"analyst": 1.0, "verifier": 1.0, "coder": 0.8, "tester": 1.0, "reviewer": 0.4}
    assert all(0 <= n <= 2 for n in lengths.values())
    assert " note ansanalyst" in prompt(BY_NAME["coder"], work)[0]  # the coder reads the analyst's answer
    assert prompt(BY_NAME["analyst"], work)[1] == " q" and prompt(BY_NAME["verifier"], work)[1] == " verify who"


def test_every_agent_after_another_builds_on_an_output_of_its_own_model():
    """Agents that extend another's output run the same model (own-weights reuse: exact)."""
    assert {(a.name, BY_NAME[a.after].model == a.model) for a in AGENTS if a.after} == {("verifier", True), ("tester", True)}


def test_summary_counts_paths_per_rate_and_scores_only_the_analyst():
    """Per rate and agent: request count, the path mix, holders' models, quality where a reference exists."""
    rec = [{"agent": "analyst", "model": "qa", "path": "partial", "ttft_ms": 10.0, "reused_tokens": 9,
            "prompt_tokens": 10, "quality": 1.0, "rate": None, "sender_model": "base"},
           {"agent": "verifier", "model": "qa", "path": "full_reuse", "ttft_ms": 5.0, "reused_tokens": 10,
            "prompt_tokens": 11, "quality": None, "rate": 2.0, "sender_model": "qa"},
           {"agent": "coder", "model": "code", "path": "full_prefill", "ttft_ms": 30.0, "reused_tokens": 0,
            "prompt_tokens": 10, "quality": None, "rate": None, "sender_model": None}]
    rows = {(r["rate"], r["agent"]): r for r in summarize(rec)}
    assert rows[("one row", "analyst")]["paths"] == "partial:1" and rows[("one row", "analyst")]["quality"] == 1.0
    assert rows[("one row", "analyst")]["from"] == "base:1" and rows[("2/s", "verifier")]["from"] == "qa:1"
    assert rows[("one row", "coder")]["quality"] is None and rows[("one row", "coder")]["from"] == "-"
    assert ("one row", "reviewer") not in rows


def test_the_real_tier_runs_the_same_roles_at_the_same_shares():
    """The real tier's role table: the demo's roles, the same reuse shares on a real-text context,
    the row's own question for the analyst, English or Python suffixes for the others."""
    context = "Help on module m:\n\n" + " ".join(f"w{i}" for i in range(100))
    work = {**_work(), "context": context}
    assert [a.name for a in REAL.agents] == [a.name for a in DEMO.agents]
    shared = {}
    for agent in REAL.agents:
        ctx, question = prompt(agent, work, REAL)
        source = (work["outputs"][agent.after] if agent.after else context).split(" ")
        shared[agent.name] = round(common_prefix(source, ctx.split(" ")) / len(source), 1)
        assert (question == " q") == (agent.name == "analyst")
        work["answers_by"][agent.name] = f" ans{agent.name}"
        work["outputs"][agent.name] = ctx + question + work["answers_by"][agent.name]
    assert shared == {"analyst": 1.0, "verifier": 1.0, "coder": 0.8, "tester": 1.0, "reviewer": 0.4}
    assert "(the analyst's answer: ansanalyst)" in prompt(REAL.agents[2], work, REAL)[0]
    assert not any(w in (a.question or "") for a in REAL.agents for w in (" who", " ( ) :"))  # no zoo words
    assert {a.model for a in REAL.agents} == {"docqa", "code"} and REAL.receivers == ["code", "docqa"]
    assert all(p.sender == REAL.planner and p.receiver in REAL.receivers for p in REAL.pairs)


def test_answer_budgets_come_from_each_agents_task_spec():
    """Demo: every agent on the tier's task (as before tiers); real: doc_qa's budget for the
    question agents, the real code task's for the coder and tester."""
    assert {DEMO.spec(a).max_new_tokens for a in DEMO.agents} == {task_spec("multihop_qa").max_new_tokens}
    budgets = {a.name: REAL.spec(a).max_new_tokens for a in REAL.agents}
    qa, code = task_spec("doc_qa").max_new_tokens, task_spec("code_completion/real").max_new_tokens
    assert budgets == {"analyst": qa, "verifier": qa, "coder": code, "tester": code, "reviewer": qa}
    assert REAL.spec().name == "doc_qa"


def test_a_pair_without_a_saved_profile_runs_on_a_default_group(monkeypatch, tmp_path):
    """Unprofiled pair: its receiver gets the default group (a quarter of the layers), every other
    sender lists it as a reader; a profiled pair's receiver gets none, its sender waits for its config."""
    from droidmesh.shared.tools.apps import agents as A

    senders, receivers = {}, {}

    class _Proc:
        def stop(self):
            pass

    monkeypatch.setattr(A, "start_control_plane", lambda *a, **k: type("Acc", (), {"url": "nats://x",
                                                                                    "env_for": lambda self, u: {}})())
    monkeypatch.setattr(A, "start_sender", lambda access, model, model_id, starts, log_dir, env, **k:
                        senders.setdefault(model_id, {"starts": starts, **k}) and _Proc())
    monkeypatch.setattr(A, "start_service", lambda kind, args, url, **k: receivers.setdefault(args["model_id"], args)
                        and _Proc())
    monkeypatch.setattr(A, "make_rows", lambda *a: [])

    async def no_rows(*a, **k):
        return []

    monkeypatch.setattr(A, "_pipeline", no_rows)
    models = {m: ModelRef(tmp_path / m, m) for m in REAL.models}
    profiles = {"base-to-docqa": {"chosen": {"start": 3}}}
    A.run_agents(models, profiles, 1, SuiteShape(), tmp_path, lambda s: None, 0.3, 0.3, tier=REAL, layers=30)
    assert receivers["code"]["default_group"] == [0, 8] and "default_group" not in receivers["docqa"]
    assert senders["base"]["starts"] == [0, 3] and senders["base"]["paired"] == ["docqa"]
    assert {m: s["readers"] for m, s in senders.items()} == {"base": ["code"], "docqa": ["code"], "code": []}
