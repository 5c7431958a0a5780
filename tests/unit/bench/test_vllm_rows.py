"""`bench vllm-rows`' arithmetic without an engine: an answer ends at its first EOS as the
engine's own decoding would end it, and the verdicts are the rows' (agreement with a Wilson
interval, quality with a paired interval and the 5 % rule)."""

from __future__ import annotations

from droidmesh.shared.tools.bench.vllm_rows import _answer, summarize


def test_an_answer_ends_at_its_first_eos_kept():
    assert _answer([5, 6, 2, 7, 2], eos=2) == [5, 6, 2]
    assert _answer([5, 6], eos=2) == [5, 6] and _answer([5, 2], eos=None) == [5, 2]


def test_the_summary_counts_paths_and_decides_with_intervals():
    same = [{"same_path": "full_reuse", "first_token_equal": i != 0, "greedy_agreement": 1.0} for i in range(10)]
    pair = [{"pair_path": "partial", "pair_first_token_equal": True, "quality_alone": q, "quality_plan": q,
             "document": f"d{i // 2}"} for i, q in enumerate([0.0, 1.0, 0.5, 1.0] * 5)]
    s = summarize(same, pair, {"full_prefill": [1.0] * 20, "plan": [0.5] * 20})
    assert s["rows"] == {"same_model": 10, "pair": 20} and s["pair"]["documents"] == 10
    assert s["same_model"]["paths"] == {"full_reuse": 10} and s["same_model"]["first_token_equal"] == 0.9
    lo, hi = s["same_model"]["first_token_interval"]
    assert lo < 0.9 < hi < 1.0
    assert s["pair"]["vllm"]["verdict"] == "within" and s["pair"]["vllm"]["relative"] == 0.0
    assert s["pair"]["droidmesh_engine"]["verdict"] == "below"  # half of full prefill's on every row
