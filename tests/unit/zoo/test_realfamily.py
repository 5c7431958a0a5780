"""The real-family tier's registration (nothing is built here: `tests/system/test_real_family.py`
runs the models): both directions are pairs, the tier is searched and buildable, its license
note names the Gemma terms, and the repository holds nothing of it but a README."""

from __future__ import annotations

from click.testing import CliRunner

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.tools.cli.zoo import build
from droidmesh.shared.zoo import realfamily
from droidmesh.shared.zoo.manifest import TIER_ORDER


def test_each_model_is_a_source_and_a_target():
    pairs = {(p.sender, p.receiver) for p in realfamily.TRANSLATE_PAIRS}
    assert pairs == {("smollm2", "gemma"), ("gemma", "smollm2")}
    assert all(p.task == realfamily.TASK == "doc_qa" for p in realfamily.TRANSLATE_PAIRS)


def test_the_tier_is_searched_and_buildable_and_says_the_gemma_terms():
    assert TIER_ORDER[-1] == realfamily.TIER == "real-family"
    assert "real-family" in CliRunner().invoke(build, ["--help"]).output
    assert "Gemma Terms of Use" in realfamily.LICENSE_NOTE and "user's choice" in realfamily.LICENSE_NOTE
    assert realfamily.recipe_hash() == realfamily.recipe_hash()


def test_nothing_of_the_tier_is_committed_but_its_readme():
    d = ZOO_DIR / "real-family"
    assert sorted(p.name for p in d.iterdir()) == ["README.md"]


def test_gemma_has_a_same_family_pair_with_its_own_fine_tune():
    assert [(p.sender, p.receiver, p.task) for p in realfamily.PAIRS] == [("gemma", "docqa", "doc_qa")]
    assert realfamily.GEMMA_FINE_TUNE.name == "docqa" and realfamily.GEMMA_FINE_TUNE.task == realfamily.TASK


def _fake_training(calls):
    def train(base, out, ft, say, base_ref="../base"):
        calls.append((base.name, ft.name, base_ref))
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_model.safetensors").write_bytes(b"weights of a new adapter")
        return {"steps": ft.steps, "rows": ft.steps, "chars": list(ft.chars), "lr": ft.lr, "seconds": 1.0, "threads": 1,
                "loss_first": 2.0, "loss_last": 1.0, "losses": [2.0, 1.0]}

    return train


def test_the_gemma_fine_tune_is_reused_only_while_its_record_matches(tmp_path, monkeypatch):
    import json

    from droidmesh.shared.model.names import sha256_file
    from droidmesh.shared.zoo import real

    calls: list = []
    monkeypatch.setattr(real, "train_lora", _fake_training(calls))
    entry = realfamily._gemma_finetune(tmp_path, "base-sha", False, lambda s: None)  # nothing yet: trained
    assert calls == [("gemma", "docqa", "../gemma")]
    weights = tmp_path / "docqa" / "adapter_model.safetensors"
    assert entry["sha256"] == sha256_file(weights) and entry["parent"] == "gemma" and entry["kind"] == "lora"
    assert "Gemma Terms of Use" in entry["license"] and entry["training"]["loss_last"] == 1.0
    realfamily._gemma_finetune(tmp_path, "base-sha", False, lambda s: None)  # the same base: reused
    assert len(calls) == 1
    realfamily._gemma_finetune(tmp_path, "another-base", False, lambda s: None)  # another base: retrained
    assert len(calls) == 2
    weights.write_bytes(b"tampered")  # weights that are not the recorded ones: retrained
    realfamily._gemma_finetune(tmp_path, "another-base", False, lambda s: None)
    assert len(calls) == 3
    record = json.loads((tmp_path / "docqa" / "training.json").read_text())
    assert record["base_sha256"] == "another-base" and record["adapter_sha256"] == sha256_file(weights)
    record["chars"] = [1200, 2400]  # trained on shorter contexts than the recipe's: retrained
    (tmp_path / "docqa" / "training.json").write_text(json.dumps(record))
    realfamily._gemma_finetune(tmp_path, "another-base", False, lambda s: None)
    assert len(calls) == 4
