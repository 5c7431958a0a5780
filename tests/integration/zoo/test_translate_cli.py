"""`droidmesh profile --translate` and `droidmesh eval --translator` on real zoo checkpoints: the
translator file it writes, the keys the eval JSON must have, and a refused translator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.kv import translate
from droidmesh.shared.tools.cli.eval import eval_cmd
from droidmesh.shared.tools.cli.profile import profile

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft, building the ci tier


def test_profile_translate_writes_a_translator_that_eval_scores(ci_tier, tmp_path: Path) -> None:
    """The profile fits and saves the translator with its sha256; eval with that hash writes the translated keys."""
    out, _ = ci_tier
    prof = tmp_path / "prof" / "base-to-qa.json"
    res = CliRunner().invoke(profile, ["--sender", str(out / "base"), "--receiver", str(out / "qa"), "--task",
                                       "fact_lookup", "--translate", "--n-train", "4", "--n-test", "2",
                                       "--json", str(prof)])
    assert res.exit_code == 0, res.output
    result = json.loads(prof.read_text())
    file = prof.parent / "translators" / result["translator_file"]
    assert translate.file_sha256(file) == result["translator_sha256"] and result["kind"] == "translate"
    assert len(result["translator"]["r2_held_out"]) == translate.load(file).target_fp.num_layers - 1

    ev_path = tmp_path / "ev.json"
    res = CliRunner().invoke(eval_cmd, ["--sender", str(out / "base"), "--receiver", str(out / "qa"), "--task",
                                        "fact_lookup", "--n", "2", "--translator", str(file), "--translator-sha256",
                                        result["translator_sha256"], "--json", str(ev_path)])
    assert res.exit_code == 0, res.output
    ev = json.loads(ev_path.read_text())
    for key in ("receiver_full_prefill", "translated", "receiver_alone_without_context", "prefill_cost_saved",
                "translation_share", "bytes_moved"):
        assert key in ev
    assert ev["kind"] == "translate" and 0 <= ev["translated"]["quality"] <= 1

    res = CliRunner().invoke(eval_cmd, ["--sender", str(out / "base"), "--receiver", str(out / "qa"), "--task",
                                        "fact_lookup", "--n", "2", "--translator", str(file), "--translator-sha256",
                                        "0" * 64, "--json", str(ev_path)])
    assert res.exit_code == 2 and "expected 0000000000000000" in res.output and "Traceback" not in res.output


def test_zoo_list_names_the_family_tiers_translated_pairs() -> None:
    """The committed family tier's pairs are listed with kind "translate", each with its translator's sha256."""
    from droidmesh.shared.zoo.manifest import listing

    pairs = [p for p in listing()["pairs"] if p["kind"] == "translate" and p["sender"].startswith("family/")]
    assert {(p["sender"], p["receiver"]) for p in pairs} >= {("family/large", "family/small"), ("family/small", "family/other")}
    assert all(len(p["translator_sha256"]) == 64 and p["task"] == "fact_lookup" for p in pairs)


def test_the_same_calibration_gives_the_same_translator_file(ci_tier, tmp_path: Path) -> None:
    """A translator file is a function of its models and contexts: fit twice, the same sha256."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling.translate_fit import fit
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    out, _ = ci_tier
    source, target = load_model(out / "base"), load_model(out / "qa")
    contexts = [r["context"] for r in make_rows("fact_lookup", "train", 3, SuiteShape(filler=(20, 40)))]
    shas = {fit(source, target, contexts).save(tmp_path / f"t{i}.safetensors") for i in range(2)}
    assert len(shas) == 1
