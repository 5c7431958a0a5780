"""The agents workload's prompts: extend, rewrite, ignore, at the intended reusable fractions."""

from __future__ import annotations

from droidmesh.shared.agents import AGENTS, prompts, summarize
from droidmesh.shared.hashing import common_prefix

CONTEXT = " ".join(f"w{i}" for i in range(100))


def test_each_agent_reuses_its_intended_share_of_the_context():
    """The analyst keeps all of C, the coder its first 80 words, the reviewer its first 40; each
    prompt is about as long as C (the rewritten words are C's own, reversed)."""
    p = prompts(CONTEXT, " q", " ans")
    words = CONTEXT.split(" ")
    shared = {a: common_prefix(words, p[a][0].split(" ")) for a in AGENTS}
    assert shared == {"analyst": 100, "coder": 80, "reviewer": 40}
    assert all(abs(len(p[a][0].split(" ")) - 100) <= 2 for a in AGENTS)


def test_summary_counts_paths_and_scores_only_the_analyst():
    """Per agent: request count, the path mix, and quality only where a reference exists."""
    rec = [{"agent": "analyst", "model": "qa", "path": "partial", "ttft_ms": 10.0, "reused_tokens": 9,
            "prompt_tokens": 10, "quality": 1.0},
           {"agent": "coder", "model": "code", "path": "full_prefill", "ttft_ms": 30.0, "reused_tokens": 0,
            "prompt_tokens": 10, "quality": None}]
    rows = {r["agent"]: r for r in summarize(rec)}
    assert rows["analyst"]["paths"] == "partial:1" and rows["analyst"]["quality"] == 1.0
    assert rows["coder"]["quality"] is None and "reviewer" not in rows
