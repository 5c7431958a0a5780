"""A translated pair's eval carries, per path, the paired interval against the target's full
prefill with the 5 % rule applied to it (`tasks.translated._add_intervals`), and its table prints
it (`profiling.job.format_translated`): constructed rows whose verdicts are known."""

from __future__ import annotations

from droidmesh.shared.profiling.job import format_translated
from droidmesh.shared.tasks.translated import _add_intervals


def _eval(scores: dict[str, list[float]], documents: list[str]) -> dict:
    out: dict = {name: {"quality": sum(v) / len(v)} for name, v in scores.items()}
    _add_intervals(out, scores, documents)
    return out


def test_each_path_gets_its_verdict_by_document():
    n = 120
    docs = [f"d{i // 2}" for i in range(n)]  # two rows per document
    full = [1.0 if i % 3 else 0.0 for i in range(n)]
    scores = {
        "receiver_full_prefill": full,
        "translated": [0.0] * n,                                      # loses everything: below
        "translated_recompute_[0,2)": list(full),                    # the same answers: within
        "receiver_alone_without_context": [1.0 - x for x in full],   # a coin against it: undecided at best
    }
    out = _eval(scores, docs)
    assert out["translated"]["vs_full_prefill"]["verdict"] == "below"
    assert out["translated_recompute_[0,2)"]["vs_full_prefill"] == {"relative": 0.0, "interval": [0.0, 0.0],
                                                                    "verdict": "within"}
    assert out["receiver_alone_without_context"]["vs_full_prefill"]["verdict"] != "within"
    assert "vs_full_prefill" not in out["receiver_full_prefill"]
    assert out["documents"] == 60
    assert out["per_row"]["translated"] == [0.0] * n


def test_a_few_noisy_rows_are_undecided_not_a_verdict_read_off_the_mean():
    full = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    other = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # the same mean, rows disagree
    out = _eval({"receiver_full_prefill": full, "translated": other}, [str(i) for i in range(8)])
    assert out["translated"]["vs_full_prefill"]["relative"] == 0.0
    assert out["translated"]["vs_full_prefill"]["verdict"] == "undecided"


def test_the_table_prints_each_interval():
    ev = {"task": "doc_qa", "metric": "f1", "rows": 2, "source_layers": (0, 3), "translation_share": 0.2,
          "bytes_moved": {"source_e": 1e6, "target_kv": 8e6},
          "sender_alone": {"quality": 0.1, "vs_full_prefill": {"relative": -0.8, "interval": [-0.9, -0.7],
                                                               "verdict": "below"}},
          "receiver_alone_without_context": {"quality": 0.0, "fidelity": 0.3},
          "receiver_full_prefill": {"quality": 0.5, "ttft_s": 1.0},
          "translated": {"quality": 0.48, "ttft_s": 0.3, "prefill_cost_saved": 0.7, "fidelity": 0.6,
                         "vs_full_prefill": {"relative": -0.04, "interval": [-0.12, 0.03], "verdict": "undecided"}}}
    table = format_translated(ev)
    assert "-4.0% [-12.0%, +3.0%] undecided" in table
    assert "-80.0% [-90.0%, -70.0%] below" in table
