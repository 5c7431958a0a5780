"""The real-family tier's registration (nothing is built here: `tests/system/test_real_family.py`
runs the models): both directions are pairs, the tier is searched and buildable, its license
note names the Gemma terms, and the repository holds nothing of it but a README."""

from __future__ import annotations

from click.testing import CliRunner

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.cli.zoo import build
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
