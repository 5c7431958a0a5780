"""The agents workload's prompts: extend, rewrite, ignore, at the intended reusable fractions."""

from __future__ import annotations

from droidmesh.shared.apps.agents import AGENTS, BY_NAME, prompt, summarize
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
