"""`droidmesh profile` on the ci tier's real checkpoints: the JSON a user gets, end to end."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.tools.cli.main import main as cli

pytestmark = pytest.mark.slow


def test_profile_json_has_the_documented_schema_and_robustness(ci_tier, tmp_path: Path) -> None:
    """The profile JSON carries chosen/full prefill/full reuse on both splits, critical layers,
    frontier, search costs, one robustness row per shift and other zoo task whose difference is
    chosen - full prefill, and the transfer search's configs, each lowrank one with its maps file
    next to the JSON under its sha256; the frontier PNG is written."""
    out, man = ci_tier
    def path(name: str) -> str:
        return str(out / man["models"][name]["path"])

    js, png = tmp_path / "p.json", tmp_path / "p.png"
    res = CliRunner().invoke(cli, ["profile", "--sender", path("base"), "--receiver", path("qa"),
                                   "--task", "multihop_qa", "--n-train", "3", "--n-test", "3", "--exhaustive",
                                   # the ci tier's models are untrained: their full prefill scores 0 here
                                   "--allow-no-signal", "--granularity", "3", "--json", str(js), "--plot", str(png),
                                   "--budget", "0"])  # nothing cut, whatever the machine's load
    assert res.exit_code == 0, res.output
    p = json.loads(js.read_text())
    for key in ("full_prefill", "full_reuse", "chosen"):
        assert {"quality_train", "quality_test"} <= set(p[key])
    assert {"start", "end", "recomputed_layers"} <= set(p["chosen"])
    assert set(p["evaluations"]) >= {"exhaustive", "guided"} and p["evaluations"]["exhaustive"] == 3
    assert isinstance(p["critical_layers"], list) and p["frontier"][0]["recomputed_layers"] == 0
    assert p["chosen_split"]["recomputed_layers"] == p["chosen"]["recomputed_layers"]
    rows = {r["task"]: r for r in p["robustness"]}
    # the profiled task's test split, then its shifts, then the other zoo tasks
    assert next(iter(rows)) == "multihop_qa"
    assert {"multihop_qa/long", "multihop_qa/coded", "summarization", "code_completion"} <= set(rows)
    assert rows["multihop_qa"]["chosen"] == p["chosen"]["quality_test"]
    assert rows["code_completion"]["metric"] == "edit_sim"
    for r in rows.values():
        assert r["difference"] == pytest.approx(r["chosen"] - r["full_prefill"])
    assert png.stat().st_size > 10_000
    assert "robustness summarization" in res.output
    configs = p["transfer"]["configs"]
    assert {c["codec"] for c in configs} - {"layered"} == {"raw", "int8", "int4", "lowrank"}
    # the per-layer codec: chosen on the train probe rows; a config when it is not raw
    chosen = p["transfer"]["layered"]["chosen"]
    layered = [c for c in configs if c["codec"] == "layered"]
    assert [c["codec_params"] for c in layered] == ([] if chosen["codec"] == "raw" else [chosen["codec_params"]])
    for c in configs:
        if c["codec"] == "lowrank":
            data = (tmp_path / "maps" / f"{c['maps_sha256']}.safetensors").read_bytes()
            assert hashlib.sha256(data).hexdigest() == c["maps_sha256"]
            assert c["wire_bytes_per_token"] < c["raw_bytes_per_token"] or c["plan"]["patch"]


def test_profile_rejects_an_unknown_robustness_task(ci_tier, tmp_path: Path) -> None:
    """A robustness task the zoo does not know is a clear error, not a crash mid-profile."""
    out, man = ci_tier
    def path(name: str) -> str:
        return str(out / man["models"][name]["path"])

    res = CliRunner().invoke(cli, ["profile", "--sender", path("base"), "--receiver", path("qa"),
                                   "--task", "multihop_qa", "--other-task", "poetry", "--n-train", "1",
                                   "--n-test", "1", "--json", str(tmp_path / "p.json")])
    assert res.exit_code != 0
    assert "poetry" in str(res.exception) or "poetry" in res.output


def test_profile_on_a_user_jsonl_with_rouge_l_and_zoo_names(ci_tier, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own JSONL (one file, split in two), metric Rouge-L, answer length and stop
    string given, models named as `zoo list` names them, and another JSONL as robustness data:
    the profile JSON scores both with rouge_l and names the pair `base-to-summ`."""
    out, _ = ci_tier
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(out.parent))
    runner = CliRunner()
    mine, other = tmp_path / "mine.jsonl", tmp_path / "other.jsonl"
    for path, split in ((mine, "train"), (other, "test")):
        res = runner.invoke(cli, ["zoo", "data", "--task", "summarization", "--split", split, "--n", "4",
                                  "--tier", "ci", "--out", str(path)])
        assert res.exit_code == 0, res.output
    js = tmp_path / "p.json"
    res = runner.invoke(cli, ["profile", "--sender", "ci/base", "--receiver", "ci/summ", "--task", "titles",
                              "--data", str(mine), "--metric", "rouge_l", "--max-new-tokens", "4", "--stop", " end",
                              "--other-task", str(other), "--granularity", "3", "--guided-only", "--allow-no-signal",
                              "--budget", "0", "--json", str(js)])
    assert res.exit_code == 0, res.output
    p = json.loads(js.read_text())
    assert (p["sender"], p["receiver"], p["task"]) == ("base", "summ", "titles")
    rows = {r["task"]: r for r in p["robustness"]}
    assert list(rows) == ["titles", str(other)]
    assert {r["metric"] for r in rows.values()} == {"rouge_l"}
    assert rows["titles"]["chosen"] == p["chosen"]["quality_test"]
    assert "base-to-summ on titles" in res.output

