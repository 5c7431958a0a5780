"""The ci tier: deterministic build, ordinary HF checkpoints, caching, listing and eval CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import sha256_file
from droidmesh.shared.zoo import build_tier
from droidmesh.shared.zoo.manifest import resolve_model

pytestmark = pytest.mark.slow


def test_two_builds_give_identical_weights(ci_tier, tmp_path: Path) -> None:
    """Same recipe and seed -> bit-identical weight files (sha256) for every model."""
    _, first = ci_tier
    second = build_tier("ci", tmp_path / "again")
    assert {k: m["sha256"] for k, m in first["models"].items()} == {k: m["sha256"] for k, m in second["models"].items()}
    assert first["recipe_hash"] == second["recipe_hash"]


def test_checkpoints_are_ordinary_hf_checkpoints(ci_tier) -> None:
    """Full models load with AutoModelForCausalLM + AutoTokenizer; the LoRA adapter merges via load_model."""
    out, man = ci_tier
    assert {"base", "qa", "summ", "code"} <= set(man["models"])
    for m in man["models"].values():
        path = out / m["path"]
        if m["kind"] == "full":
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
            assert model.config.model_type == "llama" and model.config.max_position_embeddings >= 4096
            assert AutoTokenizer.from_pretrained(path) is not None
        else:
            cfg = json.loads((path / "adapter_config.json").read_text())
            assert cfg["base_model_name_or_path"] == "../base"
        adapter = load_model(path)
        assert adapter.num_layers == man["models"]["base"]["layers"]
        assert sha256_file(path / m["weights"]) == m["sha256"]
    # at least three models share the base, so there are >= 2 sender -> receiver pairs
    assert sum(m["parent"] == "base" for m in man["models"].values()) >= 3
    assert len(man["pairs"]) >= 2


def test_cached_build_is_reused_and_a_damaged_one_rebuilt(ci_tier, tmp_path: Path) -> None:
    """A current build is returned as is; a damaged weight file makes the next call rebuild it."""
    out, man = ci_tier
    again = build_tier("ci", out)
    assert again["build_seconds"] == man["build_seconds"]  # the very same manifest, nothing retrained
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(out, copy)
    (copy / "summ" / "model.safetensors").write_bytes(b"broken")
    rebuilt = build_tier("ci", copy)
    assert rebuilt["models"]["summ"]["sha256"] == man["models"]["summ"]["sha256"]


def test_zoo_list_and_eval_cli(ci_tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`zoo list --json` shows the tier's models and pairs; `eval` writes the required JSON keys."""
    from droidmesh.shared.tools.cli.eval import eval_cmd
    from droidmesh.shared.tools.cli.zoo import zoo

    out, _ = ci_tier
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(out.parent))
    runner = CliRunner()
    res = runner.invoke(zoo, ["list", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    names = {m["name"] for m in data["models"] if m["tier"] == "ci"}
    assert {"ci/base", "ci/qa", "ci/summ", "ci/code"} <= names
    qa = next(m for m in data["models"] if m["name"] == "ci/qa")
    assert qa["parent"] == "ci/base" and qa["fine_tuned_for"] == "multihop_qa"
    assert {"tier": "ci", "kind": "reuse", "sender": "ci/summ", "receiver": "ci/qa", "task": "multihop_qa",
            "id": "summ-to-qa"} in data["pairs"]
    path = tmp_path / "ev.json"
    res = runner.invoke(eval_cmd, ["--sender", "ci/summ", "--receiver", "ci/qa", "--task", "multihop_qa",
                                   "--split", "test", "--n", "2", "--json", str(path)])
    assert res.exit_code == 0, res.output
    ev = json.loads(path.read_text())
    for k in ("total_layers", "sender_alone", "receiver_full_prefill", "receiver_full_reuse", "per_layer_reuse", "best_groups"):
        assert k in ev
    assert len(ev["per_layer_reuse"]) == ev["total_layers"]


def test_eval_cli_on_a_user_jsonl_dataset(ci_tier, tmp_path: Path) -> None:
    """`eval --data` scores any LongBench-style JSONL with local checkpoint paths."""
    from droidmesh.shared.tasks.jsonl import write_jsonl
    from droidmesh.shared.tools.cli.eval import eval_cmd

    out, _ = ci_tier
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [{"context": "doc north anna amber . bruno basil .", "input": "ask anna", "answers": ["amber"]}])
    path = tmp_path / "ev.json"
    res = CliRunner().invoke(eval_cmd, ["--sender", str(out / "summ"), "--receiver", str(out / "code"), "--task", "mine",
                                        "--data", str(data), "--group-sizes", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    ev = json.loads(path.read_text())
    assert ev["rows"] == 1 and ev["metric"] == "f1" and len(ev["best_groups"]) == 1


def test_a_zoo_name_and_its_path_resolve_to_the_same_model_and_hash(ci_tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ci/qa` and the checkpoint directory it names are one model: same path, and the hash
    computed over the directory's weights equals the manifest's (full model and LoRA adapter)."""
    out, man = ci_tier
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(out.parent))
    for name in ("qa", "code"):
        by_name, by_path = resolve_model(f"ci/{name}"), resolve_model(str(out / name))
        assert by_name.path.resolve() == by_path.path.resolve() and by_name.tier == "ci" and by_path.tier is None
        assert by_name.name == by_path.name == name
        assert by_name.sha256 == by_path.sha256 == man["models"][name]["sha256"]


def test_eval_in_shards_merged_by_the_cli_is_the_eval_of_all_rows(ci_tier, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval --shard 0/2` and `1/2` (exact groups, no sender alone), then `eval-merge`: the merged
    JSON is the one-process eval of the same rows, to float tolerance; one shard alone is refused;
    `eval --jobs 2` (two worker processes, parts merged) is the same eval too."""
    from droidmesh.shared.tools.cli.eval import eval_cmd, eval_merge

    out, _ = ci_tier
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(out.parent))
    common = ["--sender", "ci/summ", "--receiver", "ci/qa", "--task", "multihop_qa", "--n", "5", "--groups", "2:4",
              "--layer-stride", "0", "--no-sender-alone", "--wire", "int8"]
    runner = CliRunner()
    for argv in (["--json", str(tmp_path / "all.json")], *(["--shard", f"{k}/2", "--json", str(tmp_path / f"{k}.json")]
                                                          for k in range(2))):
        res = runner.invoke(eval_cmd, [*common, *argv])
        assert res.exit_code == 0, res.output
        assert "[2,4) @int8" in res.output and "rows changed" in res.output, res.output
    res = runner.invoke(eval_merge, [str(tmp_path / "1.json"), str(tmp_path / "0.json"), "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    whole, merged = (json.loads((tmp_path / n).read_text()) for n in ("all.json", "m.json"))
    assert merged["rows"] == whole["rows"] == 5 and merged["sender_alone"] is None
    for path in ("receiver_full_prefill", "receiver_full_reuse"):
        assert merged[path]["quality"] == pytest.approx(whole[path]["quality"], abs=1e-6)
        assert merged[path]["kl"] == pytest.approx(whole[path]["kl"], rel=1e-4, abs=1e-6)
    assert [(g["start"], g["end"]) for g in merged["groups"]] == [(2, 4)]
    assert [(c["path"], c["wire"], c["rows_changed"]) for c in merged["coded"]] == [
        (c["path"], c["wire"], c["rows_changed"]) for c in whole["coded"]]
    assert {(c["path"], c["wire"]) for c in merged["coded"]} == {("receiver_full_reuse", "int8"), ("group/2/4", "int8")}
    alone = runner.invoke(eval_merge, [str(tmp_path / "0.json"), "--json", str(tmp_path / "x.json")])
    assert alone.exit_code != 0 and "3 rows of 5" in alone.output
    res = runner.invoke(eval_cmd, [*common, "--jobs", "2", "--json", str(tmp_path / "jobs.json")])  # two processes
    assert res.exit_code == 0, res.output
    jobs = json.loads((tmp_path / "jobs.json").read_text())
    assert jobs["rows"] == 5 and "per_row" not in jobs and not (tmp_path / "jobs.json.parts").exists()
    for path in ("receiver_full_prefill", "receiver_full_reuse"):
        assert jobs[path]["quality"] == pytest.approx(whole[path]["quality"], abs=1e-6)
        assert jobs[path]["kl"] == pytest.approx(whole[path]["kl"], rel=1e-4, abs=1e-6)
    assert [c["wire"] for c in jobs["coded"]] == [c["wire"] for c in whole["coded"]]
