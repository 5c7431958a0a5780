"""`bench load --workload concurrency`: the per-level row and the batched / one-at-a-time
comparison from fake samples, the prompts, and the command's table and JSON with the sweep
stubbed (no mesh here; the sweep itself starts real services)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from droidmesh.shared.tools.bench import load as suite
from droidmesh.shared.tools.bench.load import Sample, concurrency_compare, concurrency_prompts, concurrency_row
from droidmesh.shared.tools.cli import bench as cli


def test_row_counts_decode_tokens_after_each_first_over_the_level_wall():
    samples = [Sample(e2e_s=2.0, decode_s=1.5, tokens=64, prompt_tokens=1030),
               Sample(e2e_s=3.0, decode_s=1.0, tokens=11, prompt_tokens=1010),  # ended its answer early
               Sample(e2e_s=1.0, decode_s=0.0, tokens=1, prompt_tokens=1020)]
    row = concurrency_row(16, 3, samples, wall_s=4.0, errors=1)
    assert (row["max_batch"], row["concurrency"], row["requests"], row["errors"]) == (16, 3, 3, 1)
    assert row["decode_tokens_per_s"] == pytest.approx((63 + 10 + 0) / 4.0)
    assert row["tokens_per_s"] == pytest.approx(76 / 4.0)
    assert row["tokens_mean"] == pytest.approx(76 / 3)
    assert row["prompt_tokens_mean"] == pytest.approx(1020)
    assert row["ttft_p50"] == pytest.approx(1.0)  # TTFTs 0.5, 2.0, 1.0: end-to-end less decode
    assert row["e2e_p50"] == pytest.approx(2.0)
    assert row["tbt_p50"] == pytest.approx((1.5 / 63 + 1.0 / 10) / 2)  # a 1-token answer has no TBT


def test_row_of_a_level_that_failed_entirely_has_no_numbers():
    row = concurrency_row(1, 4, [], wall_s=2.0, errors=4)
    assert row["requests"] == 0 and row["errors"] == 4
    assert row["decode_tokens_per_s"] == 0.0
    assert row["ttft_p50"] is None and row["tokens_mean"] is None


def _row(b: int, c: int, tps: float | None, ttft: float | None) -> dict:
    return {"max_batch": b, "concurrency": c, "decode_tokens_per_s": tps, "ttft_p50": ttft}


def test_compare_divides_each_batched_row_by_the_one_at_a_time_row_of_its_concurrency():
    rows = [_row(1, 1, 10.0, 0.5), _row(1, 8, 10.0, 4.0), _row(16, 1, 9.0, 0.5), _row(16, 8, 40.0, 1.0),
            _row(4, 8, 25.0, None)]
    got = concurrency_compare(rows)
    assert [(r["concurrency"], r["max_batch"]) for r in got] == [(1, 16), (8, 4), (8, 16)]
    assert got[0]["speedup_decode"] == pytest.approx(0.9) and got[0]["ttft_ratio"] == pytest.approx(1.0)
    assert got[1]["speedup_decode"] == pytest.approx(2.5) and got[1]["ttft_ratio"] is None
    assert got[2]["speedup_decode"] == pytest.approx(4.0) and got[2]["ttft_ratio"] == pytest.approx(0.25)
    assert {r["baseline_batch"] for r in got} == {1}


def test_compare_without_max_batch_1_uses_the_smallest_and_skips_unmatched_levels():
    got = concurrency_compare([_row(2, 1, 10.0, 1.0), _row(8, 1, 20.0, 1.0), _row(8, 4, 30.0, 1.0)])
    assert [(r["concurrency"], r["max_batch"], r["baseline_batch"]) for r in got] == [(1, 8, 2)]
    assert concurrency_compare([]) == []


def test_filler_prompts_are_distinct_and_sized_in_words():
    prompts = concurrency_prompts("filler", 32, 5)
    assert len(set(prompts)) == 5
    assert all(len(context.split()) == 32 for context, _ in prompts)


class _WordTokenizer:
    """A stand-in for the receiver's tokenizer: one token a whitespace-separated word."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": text.split()}

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def test_real_prompts_are_doc_qa_rows_cut_to_the_token_count():
    prompts = concurrency_prompts("real", 100, 4, _WordTokenizer())
    assert len(set(prompts)) == 4
    assert all(len(context.split()) == 100 for context, _ in prompts)
    assert all(question.strip().startswith("Question:") for _, question in prompts)


def test_command_prints_rows_and_ratios_and_saves_the_load_average(monkeypatch, tmp_path):
    seen = {}

    def fake(receiver, tokens, concurrencies, batches, rounds, new_tokens, source, device, **kw):
        seen.update(tokens=tokens, concurrencies=concurrencies, batches=batches, source=source, mode=kw["mode"],
                    dtype=kw["dtype"], pool_tokens=kw["pool_tokens"])
        rows = [concurrency_row(b, c, [Sample(1.0, 0.5, new_tokens, tokens)], 1.0) for b in batches for c in concurrencies]
        return {"rows": rows, "compare": concurrency_compare(rows), "loadavg_start": [0.1, 0.2, 0.3],
                "loadavg_end": [0.4, 0.5, 0.6], "mode": kw["mode"], "dtype": kw["dtype"]}

    monkeypatch.setattr(suite, "run_concurrency", fake)
    out = tmp_path / "lc.json"
    res = CliRunner().invoke(cli.bench, ["load", "--workload", "concurrency", "--concurrency", "2,1", "--batch", "4,1",
                                         "--new-tokens", "8", "--pool-tokens", "640", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert seen == {"tokens": 1024, "concurrencies": [1, 2], "batches": [1, 4], "source": "filler",
                    "mode": "full_prefill", "dtype": "float32", "pool_tokens": 640}
    assert "speedup_decode" in res.output and "decode pool of 640 tokens" in res.output and "load average" in res.output
    saved = json.loads(out.read_text())
    assert saved["suite"] == "load_concurrency" and saved["mode"] == "full_prefill"
    assert saved["loadavg_end"] == [0.4, 0.5, 0.6]
    assert [(r["concurrency"], r["max_batch"]) for r in saved["compare"]] == [(1, 4), (2, 4)]
