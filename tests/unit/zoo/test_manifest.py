"""Naming models and pairs: the one resolver (zoo names and checkpoint paths) and the pair id."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.errors import CheckpointNotFoundError
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import Pair
from droidmesh.shared.tools.cli.main import main as cli
from droidmesh.shared.zoo.manifest import listing, profile_file, resolve_model


@pytest.fixture
def fake_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A built-looking ci tier (manifest + config files, no real weights) under DROIDMESH_ZOO_DIR."""
    root = tmp_path / "zoo" / "ci"
    models = {}
    for name in ("base", "mini"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
        (root / name / "model.safetensors").write_bytes(name.encode())
        models[name] = {"path": name, "kind": "full", "parent": None if name == "base" else "base",
                        "task": "t", "layers": 4, "sha256": f"{name}-hash", "weights": "model.safetensors"}
    (root / "manifest.json").write_text(json.dumps({"tier": "ci", "models": models,
                                                    "pairs": [{"sender": "base", "receiver": "mini", "task": "t"}]}))
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(tmp_path / "zoo"))
    return root


def test_zoo_names_resolve_with_or_without_their_tier(fake_tier: Path) -> None:
    """`ci/mini` and `mini` (the first tier holding it) name the same model, with the
    manifest's hash; a bare name held by several tiers is the first in `zoo list`'s order."""
    a, b = resolve_model("ci/mini"), resolve_model("mini")
    assert a == b and a.path == fake_tier / "mini" and (a.name, a.tier, a.label) == ("mini", "ci", "ci/mini")
    assert a.sha256 == "mini-hash"
    assert resolve_model("ci/base").tier == "ci" and resolve_model("base").tier == "demo"


def test_a_checkpoint_path_resolves_with_its_weights_hash(fake_tier: Path) -> None:
    """A directory with config.json is a checkpoint: named after the directory, hashed over its weights."""
    ref = resolve_model(str(fake_tier / "base"))
    assert (ref.name, ref.tier) == ("base", None)
    assert ref.sha256 == hashlib.sha256(b"base").hexdigest()
    assert resolve_model(str(fake_tier / "base"), name="sender-a").name == "sender-a"


def test_unknown_models_are_a_clear_error(fake_tier: Path) -> None:
    """Neither a checkpoint nor a zoo model (nor a model of another tier): CheckpointNotFoundError."""
    for arg in ("nope", "demo/nope", str(fake_tier)):
        with pytest.raises(CheckpointNotFoundError, match="zoo list"):
            resolve_model(arg)


@pytest.mark.parametrize("arg", ["~droidmesh-no-such-user/ckpt", "~0"])
def test_a_home_of_a_user_this_host_lacks_is_no_checkpoint_not_a_crash(fake_tier: Path, arg: str) -> None:
    """pathlib raises RuntimeError expanding it; a model argument (a profile request's path, from a
    peer) must get the one-line answer every unknown model gets, never an internal error."""
    with pytest.raises(CheckpointNotFoundError, match="neither a local checkpoint"):
        resolve_model(arg)
    with pytest.raises(CheckpointNotFoundError, match="no local checkpoint"):
        load_model(arg)


def test_commands_report_an_unknown_model_in_one_line(fake_tier: Path, tmp_path: Path) -> None:
    """eval and profile turn an unknown model into a usage error naming it, never a traceback."""
    for cmd in ("eval", "profile"):
        res = CliRunner().invoke(cli, [cmd, "--sender", "ci/nope", "--receiver", "ci/mini", "--task", "t",
                                       "--json", str(tmp_path / "x.json")])
        assert res.exit_code == 2 and "ci/nope" in res.output and isinstance(res.exception, SystemExit)


def test_one_pair_id_everywhere(fake_tier: Path) -> None:
    """The pair id is `sender-to-receiver` in listings, profile file names and versioned names."""
    pair = Pair("base", "qa")
    assert pair.id == "base-to-qa" and pair.versioned(3) == "base-to-qa v3"
    assert {p["id"] for p in listing()["pairs"] if p["tier"] == "ci"} == {"base-to-mini"}
    assert profile_file(fake_tier, pair).name == "base-to-qa.json"
    assert profile_file(fake_tier, pair, ".png").name == "base-to-qa.png"


def test_a_profile_failing_its_test_split_is_not_served(tmp_path) -> None:
    """demo and agents serve a saved profile only when its choice passes the test split (as
    `config publish` refuses it otherwise); the pair then runs on the default group."""
    import json

    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.zoo.manifest import profile_file, servable_profiles

    good, bad, missing = Pair("base", "qa", "t"), Pair("base", "summ", "t"), Pair("base", "code", "t")
    for pair, passes in ((good, True), (bad, False)):
        f = profile_file(tmp_path, pair)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"chosen": {"start": 0, "end": 2, "passes_test": passes}}))
    said: list[str] = []
    got = servable_profiles(tmp_path, [good, bad, missing], said.append)
    assert list(got) == [good.id] and len(said) == 1 and bad.id in said[0]
