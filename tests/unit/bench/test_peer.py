"""`bench peer`: the side-by-side rows and targets from fixed timings, the peer protocol against a
stand-in `vllm` package run by a real subprocess (vLLM itself is not installed in CI), and our
side's batched decode against each prompt decoded alone."""

from __future__ import annotations

import sys
import textwrap

import pytest

from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.tools.bench import peer

FAKE_VLLM = '''
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, ids):
        self.token_ids = ids

class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]

class LLM:
    def __init__(self, model, dtype, enable_prefix_caching, seed, max_model_len, max_num_seqs):
        assert not enable_prefix_caching, "a repeated prompt must be prefilled again"
        self.max_model_len = max_model_len

    def generate(self, prompts, params, use_tqdm):
        out = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            assert len(ids) + params.max_tokens <= self.max_model_len
            out.append(_Output([len(ids) + i for i in range(params.max_tokens)]))  # echoes the prompt's length
        return out
'''


def _peer_result(ttft: dict[str, float], first: dict[str, int], decode_all: list[float], decode_one: list[float],
                 tokens: list[list[int]]) -> dict:
    return {"engine": "vllm", "version": "x", "load_s": 1.0,
            "ttft": {n: {"ttft_s": s, "times_s": [s], "first_tokens": [first[n]]} for n, s in ttft.items()},
            "decode": {"one_token_s": decode_one, "all_tokens_s": decode_all, "tokens": tokens}}


def test_rows_and_targets_from_fixed_timings():
    peer_out = _peer_result({"1024": 2.0, "2048": 5.0}, {"1024": 7, "2048": 9}, [3.0, 3.2], [1.0, 1.0],
                            [[1, 2, 3, 4], [5, 6, 7, 8]])
    ours = {"ttft": {1024: [{"mode": "full_prefill", "recomputed_layers": 30, "ttft_s": 2.4, "first_token": 7},
                            {"mode": "partial", "recomputed_layers": 3, "ttft_s": 0.5, "first_token": 7},
                            {"mode": "full_reuse", "recomputed_layers": 0, "ttft_s": 0.2, "first_token": 8}],
                     2048: [{"mode": "full_prefill", "recomputed_layers": 30, "ttft_s": 7.0, "first_token": 9},
                            {"mode": "partial", "recomputed_layers": 3, "ttft_s": 0.8, "first_token": 9}]},
            "decode_tokens_per_s": 2.0, "tokens": [[1, 2, 0, 4], [5, 6, 7, 8]]}
    out = peer.rows(peer_out, ours, batch=2, new_tokens=4)
    by = {(r["context_tokens"], r["engine"], r["mode"]): r for r in out["ttft"]}
    assert by[(1024, "droidmesh", "partial")]["peer_full_over_this"] == pytest.approx(4.0)
    assert by[(1024, "droidmesh", "full_reuse")]["first_token_as_peer"] is False
    d = out["decode"]
    assert d["vllm_tokens_per_s"] == pytest.approx(2 * 3 / 2.1)  # median of (3.0 - 1.0, 3.2 - 1.0)
    assert d["droidmesh_over_vllm"] == pytest.approx(2.0 / (6 / 2.1))
    assert d["same_tokens_share"] == pytest.approx((2 / 4 + 4 / 4) / 2)  # the first row parts at its third token
    t = peer.targets(out["ttft"], d, k=3)
    assert t["full_prefill_over_vllm"] == {1024: pytest.approx(1.2), 2048: pytest.approx(1.4)}
    assert t["full_prefill_within_1_25"] is False
    assert t["vllm_full_over_partial_3_at_2048"] == pytest.approx(6.25) and t["partial_at_least_5x"] is True
    assert t["decode_at_least_half"] is True


def _stand_in_peer(root, monkeypatch) -> None:
    """A `vllm` package that `python` (this interpreter) imports in the peer subprocess."""
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", str(root))


def test_the_peer_subprocess_gets_the_same_token_ids(tmp_path, monkeypatch):
    _stand_in_peer(tmp_path, monkeypatch)
    ttft_prompts = {64: ([1] * 64, [2] * 5), 128: ([3] * 128, [4] * 7)}
    decode_prompts = [([5] * 20, [6] * 3), ([7] * 30, [8])]
    out = peer.run_vllm(sys.executable, "/nowhere", "bfloat16", ttft_prompts, decode_prompts, new_tokens=4, repeats=2,
                        core=0, timeout_s=60)
    assert out["version"] == "0.0-fake"
    assert out["ttft"]["64"]["first_tokens"] == [69, 69, 69] and len(out["ttft"]["64"]["times_s"]) == 2
    assert out["ttft"]["128"]["first_tokens"][0] == 135
    assert out["decode"]["tokens"] == [[23, 24, 25, 26], [31, 32, 33, 34]]
    assert len(out["decode"]["all_tokens_s"]) == len(out["decode"]["one_token_s"]) == 2


def test_a_failing_or_missing_peer_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(peer.PeerError, match="no peer python"):
        peer.run_vllm(str(tmp_path / "python"), "/m", "bfloat16", {}, [([1], [2])], 4, 1, 0, 60)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('vllm wants a GPU driver')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(peer.PeerError, match=r"exited with 1: ImportError: vllm wants a GPU driver") as e:
        peer.run_vllm(sys.executable, "/m", "bfloat16", {8: ([1] * 8, [2])}, [([1], [2])], 4, 1, 0, 60)
    assert "\n" not in str(e.value)
    (tmp_path / "vllm" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(peer.PeerError, match="did not finish within 1 s"):
        peer.run_vllm(sys.executable, "/m", "bfloat16", {8: ([1] * 8, [2])}, [([1], [2])], 4, 1, 0, 1.0)


def test_our_batched_decode_round_equals_each_prompt_alone(tiny_models):
    model = tiny_models[1]
    prompts = [(list(range(5, 5 + n)), [9, 10]) for n in (12, 30, 21)]
    seconds, tokens = peer._decode_round(model, prompts, new_tokens=6)
    alone = [generate(model, c + q, ReusePlan.full_prefill(), None, max_new_tokens=6).tokens for c, q in prompts]
    assert seconds > 0
    assert tokens == alone


def test_the_command_runs_both_sides_and_writes_its_json(tiny_pair, tmp_path, monkeypatch):
    """`droidmesh bench peer` end to end against the stand-in peer: the table, the targets, the JSON."""
    import json
    import os

    from click.testing import CliRunner

    from droidmesh.shared.tools.cli.main import main

    _stand_in_peer(tmp_path, monkeypatch)
    cores = os.sched_getaffinity(0)
    core = min(cores)
    args = ["bench", "peer", "--peer-python", sys.executable, "--model", str(tiny_pair[1]), "--contexts", "32,48",
            "--batch", "2", "--decode-context", "24", "--new-tokens", "4", "--repeats", "1", "--dtype", "float32",
            "--core", str(core), "--json", str(tmp_path / "peer.json"), "--plot", str(tmp_path / "peer.png")]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "decode_over_vllm" in result.stdout
    saved = json.loads((tmp_path / "peer.json").read_text())
    assert {(r["context_tokens"], r["engine"], r["mode"]) for r in saved["ttft"]} == {
        (n, e, m) for n in (32, 48) for e, m in (("vllm", "full_prefill"), ("droidmesh", "full_prefill"),
                                                  ("droidmesh", "partial"), ("droidmesh", "full_reuse"))}
    assert saved["peer"]["version"] == "0.0-fake" and saved["decode"]["batch"] == 2
    assert os.sched_getaffinity(0) == cores  # pinned for our side only
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_the_command_refuses_an_adapter(tmp_path):
    from click.testing import CliRunner

    from droidmesh.shared.tools.cli.main import main

    for d in ("base", "lora"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    (tmp_path / "lora" / "adapter_config.json").write_text('{"base_model_name_or_path": "../base"}')
    result = CliRunner().invoke(main, ["bench", "peer", "--peer-python", sys.executable, "--model",
                                       str(tmp_path / "lora")])
    assert result.exit_code == 2 and "is an adapter; give a full checkpoint" in result.output
