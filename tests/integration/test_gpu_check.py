"""The prepared GPU check (`infra/gpu/check.sh`): its `--tiny` CPU run end to end, the JSON the
issue asks for. No timing is asserted; on a GPU the same script measures the real shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from droidmesh.shared.model import shapes
from droidmesh.shared.tools.bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_every_row_target_and_an_exact_recompute_all(tmp_path):
    """Rows per context and plan with the named keys, the targets (null where not measured), exactness within
    tolerance, the overlap run's landed layers giving one answer pipelined and serial, and the
    batched decode's rows choosing the solo tokens, ragged, in a decode pool, and replayed per bucket."""
    out = tmp_path / "check.json"
    proc = subprocess.run(["bash", "infra/gpu/check.sh", "--tiny", "--repeats", "1", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    keys = {"context", "plan", "graphs", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal",
            "peak_mem_gib"}
    assert all(set(r) == keys for r in report["rows"])
    graphed = {(r["context"], r["plan"]) for r in report["rows"] if r["graphs"]}
    assert graphed == {(n, p) for n in (256, 512) for p in ("full reuse", "recompute [0,2)")}
    assert report["graphs"]["layer_graphs"] == 2 * 4 * 8  # before / after, 4 token buckets, 8 layers
    assert {(r["context"], r["plan"]) for r in report["rows"]} >= {(256, "full prefill"), (512, "recompute [0,2)")}
    assert set(report["targets"]) == {"k2_32k_fraction_of_ideal", "full_reuse_64k_s", "peak_mem_32k_gib", "weights_gib",
                                      "kv_32k_gib", "batched_decode_32_at_4k_x", "graphs_on_vs_off_solo_x",
                                      "graphs_on_vs_off_batched_x", "k2_32k_fraction_of_ideal_eager",
                                      "full_reuse_64k_s_eager"}
    assert report["targets"]["k2_32k_fraction_of_ideal"] is None and report["targets"]["kv_32k_gib"] > 0
    assert report["exactness"]["ok"] and report["cacheblend_s"] > 0
    assert report["overlap"]["same_answer"] and report["overlap"]["plan"] == "recompute [0,2)"
    batched = report["batched_decode"]  # per way, every row of the batch chose the tokens one sequence alone chose
    assert [r["way"] for r in batched] == ["ragged", "pool", "graphs"]
    assert all(r["batch"] == 4 and r["same_tokens"] and r["first_divergence"] is None and r["batched_tokens_per_s"] > 0
               and (r["sequences"], r["rows_agree"], r["agree_share"]) == (5, 5, 1.0) for r in batched)
    assert "graphs" in proc.stdout and report["graphs"]["what"].startswith("cpu:")


def test_first_divergence_is_the_first_token_where_a_row_parts_from_the_solo_tokens():
    rows = [SimpleNamespace(tokens=[1, 2, 3, 4]), SimpleNamespace(tokens=[1, 2, 5, 4])]
    assert gpu_check._first_divergence(rows, [1, 2, 3, 4]) == 2
    assert gpu_check._first_divergence(rows[:1], [1, 2, 3, 4]) is None


def test_a_row_parting_at_a_near_tie_is_rounding_and_elsewhere_a_changed_answer():
    """The reference's relative top-2 margins per token: 0.5, 0.001, 0.5. A row parting at token 1
    (margin 0.001 <= the tie bound 0.01) parted by rounding; one parting at token 2 changed."""
    ref, margins = [1, 2, 3], [0.5, 0.001, 0.5]
    got = gpu_check.agreement([[1, 2, 3], [1, 9, 9], [1, 2, 9]], ref, margins, tie=0.01)
    assert got == {"sequences": 3, "rows_agree": 1, "rows_near_tie": 1, "rows_changed": 1, "agree_share": 1 / 3}
    assert gpu_check.agreement([[1, 9, 9]], ref, margins, tie=0.0001)["rows_changed"] == 1  # a tighter bound: changed


def test_named_shapes_have_the_real_architectures_sizes():
    """llama3-8b: 32 layers, 8 KV heads of 128; KV at 32K tokens in bf16 is 4 GiB."""
    family, cfg = shapes.SHAPES["llama3-8b"]
    assert family == "llama" and cfg["num_hidden_layers"] == 32 and cfg["num_key_value_heads"] == 8
    assert 2 * 32 * 8 * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 32768 * 2 == 4 << 30


def test_the_cli_lists_every_named_shape():
    """`bench ttft --shape` offers exactly the shapes the module builds."""
    from droidmesh.shared.tools.cli.bench.engine import SHAPE_NAMES

    assert set(SHAPE_NAMES) == set(shapes.SHAPES)


def test_bfloat16_exactness_is_held_to_the_models_own_rounding_and_catches_a_wrong_token(monkeypatch):
    """In bfloat16 both forwards round (own diff > 0) and recompute-all passes; one wrong input token fails."""
    model = shapes.build("tiny", "cpu", dtype="bfloat16")
    exact = gpu_check.exactness(model, 128)
    assert exact["ok"] and exact["model_forward_max_abs_diff"] > 0
    assert exact["tolerance"] == 2 * exact["model_forward_max_abs_diff"]
    real = gpu_check.prefill

    def reads_a_wrong_token(receiver, prompt, plan, source, **kw):
        return real(receiver, [*prompt[:-1], (prompt[-1] + 1) % receiver.config.vocab_size], plan, source, **kw)

    monkeypatch.setattr(gpu_check, "prefill", reads_a_wrong_token)
    assert not gpu_check.exactness(model, 128)["ok"]


def test_profile_suffix_tiny_prints_host_tables_per_plan():
    """`infra/gpu/profile_suffix.py --tiny` profiles full reuse and k = 2 on the CPU."""
    proc = subprocess.run([sys.executable, "infra/gpu/profile_suffix.py", "--tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "256 tokens full reuse" in proc.stdout and "256 tokens recompute [0,2)" in proc.stdout
    assert "Self CPU time total" in proc.stdout
