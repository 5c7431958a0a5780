"""The CLI's shared parsers: layer groups, config files for `config publish`, the profile's sample warning."""

from __future__ import annotations

import json

import click
import msgspec
import pytest

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.profiling.job import sample_warning
from droidmesh.shared.tools.apps.serve_config import load_config
from droidmesh.shared.tools.cli.params import GROUP, check_group
from droidmesh.shared.zoo.manifest import REPO_ZOO

PROFILE = REPO_ZOO / "demo" / "profiles" / "base-to-qa.json"


@pytest.mark.parametrize("text,group", [("0:6", (0, 6)), ("0,6", (0, 6)), ("4:6", (4, 6)), ("[4,6)", (4, 6)),
                                        (" 2 , 3 ", (2, 3))])
def test_group_forms(text, group):
    """START:END, START,END and [START,END) all mean [START, END), layer 0 included."""
    assert GROUP.convert(text, None, None) == group


@pytest.mark.parametrize("text", ["6:4", "3:3", "-1:2", "four", "1:2:3", ""])
def test_bad_groups(text):
    """Reversed, empty, negative and malformed groups are usage errors."""
    with pytest.raises(click.BadParameter):
        GROUP.convert(text, None, None)


def test_group_beyond_the_model():
    """A group ending past the model's last layer is refused once the layer count is known."""
    assert check_group((0, 12), 12) == (0, 12)
    with pytest.raises(BadRequestError, match="out of range"):
        check_group((0, 13), 12)


def test_profile_json_becomes_a_bound_config():
    """A profile JSON is bound to the named models' sha256s and keeps its choice."""
    cfg = load_config(str(PROFILE), version=7)
    data = json.loads(PROFILE.read_text())
    assert (cfg.sender_model, cfg.receiver_model, cfg.profile_version) == ("base", "qa", 7)
    assert cfg.chosen.plan.groups == [(data["chosen"]["start"], data["chosen"]["end"])]
    assert len(cfg.sender_sha256) == 64 and cfg.sender_sha256 != cfg.receiver_sha256


def test_recompute_config_json_round_trips(tmp_path):
    """A RecomputeConfig written as JSON (with or without its type tag) loads back equal."""
    cfg = load_config(str(PROFILE), version=3)
    raw = json.loads(msgspec.json.encode(cfg))
    for data in (raw, {k: v for k, v in raw.items() if k != "type"}):
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(data))
        assert load_config(str(path)) == cfg


@pytest.mark.parametrize(
    "change,match",
    [
        ({"sender_sha256": "abc"}, "sender_sha256"),
        ({"total_layers": 4}, "outside 0..4"),
        ({"tolerance": 1.5}, "tolerance"),
        ({"frontier": []}, "frontier is empty"),
        ({"profile_version": "one"}, "invalid RecomputeConfig"),
        ({"chosen": {"plan": {"groups": [[4, 6]], "codec": "zip"}, "recomputed_layers": 2, "quality": 1.0}}, "codec"),
        ({"chosen": {"plan": {"groups": [[4, 6]]}, "recomputed_layers": 3, "quality": 1.0}}, "recomputed_layers 3"),
    ],
)
def test_invalid_configs_are_refused(tmp_path, change, match):
    """Each inconsistency in a RecomputeConfig file is a one-line BadRequestError naming it."""
    raw = {**json.loads(msgspec.json.encode(load_config(str(PROFILE), version=1))), **change}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(BadRequestError, match=match):
        load_config(str(path))


def _result(fp: float, fr: float) -> dict:
    return {"full_prefill": {"quality_test": fp}, "full_reuse": {"quality_test": fr}}


@pytest.mark.parametrize(
    "result,rows,warns",
    [
        (_result(0.9, 0.3), 50, None),             # a clear loss on enough rows: the choice means something
        (_result(0.9, 0.3), 8, "only 8 test rows"),  # too few rows
        (_result(0.9, 0.85), 50, "sampling noise"),  # a loss within 1/sqrt(50) = 0.14 of noise
    ],
)
def test_sample_warning_rule(result, rows, warns):
    """The profile warns below 20 test rows or when full reuse loses less than 1/sqrt(rows)."""
    got = sample_warning(result, rows)
    assert got is None if warns is None else warns in got


@pytest.mark.parametrize("models,expect", [(["qa"], "qa"), ([], "no receiver answered"),
                                           (["qa", "summ"], "2 receiver models are up (qa, summ)")])
def test_default_receiver(monkeypatch, models, expect):
    """`ask` without --receiver takes the one model up; none or several is a one-line error naming them."""
    import asyncio

    from droidmesh.shared.mesh.discovery import ReceiverModel
    from droidmesh.shared.tools.cli import ask

    async def fake(_nc, _window):
        return [ReceiverModel(m, ("i",), "0.1.0") for m in models]

    monkeypatch.setattr(ask, "_receivers", fake)
    if len(models) == 1:
        assert asyncio.run(ask._only_receiver(None, 0.01)) == expect
    else:
        with pytest.raises(BadRequestError, match=expect.replace("(", r"\(").replace(")", r"\)")):
            asyncio.run(ask._only_receiver(None, 0.01))
