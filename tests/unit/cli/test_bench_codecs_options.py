"""`bench codecs`' options: tier-qualified pairs, the group each pair is run at, the codec list, and
the SCD target line (no models, no mesh: a fake zoo and a stubbed run)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.tools.bench import codec_tradeoff as bc
from droidmesh.shared.tools.cli import bench as cli
from droidmesh.shared.tools.cli.bench import codecs as codecs_cli
from droidmesh.shared.tools.cli.params import checkpoint_layers
from droidmesh.shared.zoo import manifest


def _model(d, layers):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    """A demo tier (12 layers, a saved base-to-qa profile) and a real tier (30 layers, docqa a
    LoRA adapter of base) in a fake repository zoo; an empty cache directory."""
    repo = tmp_path / "repo"
    demo, real = repo / "demo", repo / "real"
    for name in ("base", "qa"):
        _model(demo / name, 12)
    (demo / "profiles").mkdir()
    (demo / "profiles" / "base-to-qa.json").write_text(json.dumps({"chosen": {"start": 4, "end": 6}}))
    (demo / "manifest.json").write_text(json.dumps({"tier": "demo", "pairs": [], "models": {
        n: {"path": n, "sha256": n * 8} for n in ("base", "qa")}}))
    _model(real / "base", 30)
    (real / "docqa").mkdir()
    (real / "docqa" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../base"}))
    (real / "manifest.json").write_text(json.dumps({"tier": "real", "pairs": [], "models": {
        n: {"path": n, "sha256": n * 8} for n in ("base", "docqa")}}))
    monkeypatch.setattr(manifest, "REPO_ZOO", repo)
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(tmp_path / "cache"))
    return repo


@pytest.mark.parametrize("spec,pair", [
    ("real/base:real/docqa", ("real/base", "real/docqa")),
    ("real/base:docqa", ("real/base", "real/docqa")),  # a bare name takes the other side's tier
    ("base:real/docqa", ("real/base", "real/docqa")),
    ("base:qa", ("base", "qa")),  # bare on both sides: resolved in the demo tier later
    (" base : qa ", ("base", "qa")),
])
def test_pair_specs(spec, pair):
    assert codecs_cli._split_pair(spec) == pair


@pytest.mark.parametrize("spec", ["base", "base:", ":qa", "real/base"])
def test_bad_pair_specs(spec):
    with pytest.raises(click.BadParameter, match="SENDER:RECEIVER"):
        codecs_cli._split_pair(spec)


def test_checkpoint_layers_of_an_adapter_are_its_bases(zoo):
    """A LoRA adapter directory has no config.json: its layer count is its base's."""
    assert checkpoint_layers(zoo / "real" / "docqa") == 30


def test_real_pair_resolves_with_the_default_group_then_its_saved_profile(zoo):
    """A real pair by tier-qualified names: paths, labels and ids; [6,12) without a profile, the
    profile's chosen group once zoo/real/profiles/<sender>-to-<receiver>.json exists."""
    (p,) = codecs_cli._codec_pairs("real/base:real/docqa")
    assert (p["name"], p["sender_label"], p["receiver_label"]) == ("base->docqa", "real/base", "real/docqa")
    assert (p["sender"], p["receiver"]) == (str(zoo / "real" / "base"), str(zoo / "real" / "docqa"))
    assert p["group"] == (6, 12) and p["group_source"].startswith("default")
    (zoo / "real" / "profiles").mkdir()
    prof = zoo / "real" / "profiles" / "base-to-docqa.json"
    prof.write_text(json.dumps({"chosen": {"start": 3, "end": 9}}))
    (p,) = codecs_cli._codec_pairs("real/base:docqa")
    assert p["group"] == (3, 9) and str(prof) in p["group_source"]


def test_group_option_overrides_every_pair_and_must_fit(zoo):
    pairs = codecs_cli._codec_pairs("base:qa,real/base:real/docqa", group=(2, 4))
    assert [(p["name"], p["group"], p["group_source"]) for p in pairs] == [
        ("base->qa", (2, 4), "--group"), ("base->docqa", (2, 4), "--group")]
    with pytest.raises(click.BadParameter, match="out of range"):
        codecs_cli._codec_pairs("base:qa", group=(8, 13))  # the demo models have 12 layers


def test_demo_pairs_keep_their_profiled_and_known_groups(zoo):
    """Bare names are the demo tier's: base->qa from its saved profile; a demo pair without one
    from the known groups."""
    by_name = {p["name"]: p for p in codecs_cli._codec_pairs("base:qa,qa:base")}
    assert by_name["base->qa"]["group"] == (4, 6)
    assert by_name["qa->base"]["group"] == (6, 12)


@pytest.mark.parametrize("spec,match", [("real/base:real/nope", "neither"), ("base:qa,base:qa", "two pairs"),
                                        ("base:qa,", None)])
def test_bad_pairs(zoo, spec, match):
    if match is None:  # a trailing comma is nothing
        assert len(codecs_cli._codec_pairs(spec)) == 1
        return
    with pytest.raises(click.BadParameter, match=match):
        codecs_cli._codec_pairs(spec)


def test_codec_choices():
    assert codecs_cli._codec_choices(None, None, "raw,int8,int4,scd") == ["raw", "int8", "int4", "scd"]
    assert codecs_cli._codec_choices(None, None, "all") == list(bc.CODEC_CHOICES)
    assert codecs_cli._codec_choices(None, None, "scd,scd") == ["scd"]
    with pytest.raises(click.BadParameter):
        codecs_cli._codec_choices(None, None, "raw,zstd")
    with pytest.raises(click.BadParameter):
        codecs_cli._shares(None, None, "0.9,1.5")
    assert codecs_cli._shares(None, None, "0.9") == [0.9]


def test_configs_of_a_30_layer_pair_restricted_to_some_codecs_and_shares():
    """The baselines always; then only the families asked for, lowrank at the shares asked for."""
    cs = bc.configs(ReusePlan.recompute(6, 12), 30, ("raw", "scd"), (0.9,))
    assert [c.family for c in cs] == ["full prefill", "full reuse", "raw", "lowrank"]
    assert cs[-1].share == 0.9 and cs[-1].plan == ReusePlan.recompute(6, 12) and cs[-1].name == "lowrank s0.9 [6,12)"
    assert {c.family for c in bc.configs(ReusePlan.recompute(6, 12), 30)} == set(bc.FAMILIES)
    with pytest.raises(ValueError, match="unknown codec"):
        bc.configs(ReusePlan.recompute(6, 12), 30, ("zstd",))


def _row(config, family, quality, bytes_vs_raw, tokens=1024, link=None):
    return {"pair": "base->docqa", "target_tokens": tokens, "link_gbit": link, "config": config, "family": family,
            "quality": quality, "quality_vs_full": quality / 0.5, "bytes_vs_raw": bytes_vs_raw,
            "bytes_vs_raw_group": bytes_vs_raw * 1.25, "wire_bytes": bytes_vs_raw * 1000, "kl": 0.1, "top1": 0.9,
            "plan": {}}


TARGET_ROWS = [_row("full prefill", "full prefill", 0.5, 0.0), _row("full reuse raw", "full reuse", 0.3, 1.25),
               _row("raw [6,12)", "raw", 0.5, 1.0), _row("int4 [6,12)", "int4", 0.5, 0.19),
               _row("lowrank s0.8 [6,12)", "lowrank", 0.40, 0.10), _row("lowrank s0.9 [6,12)", "lowrank", 0.48, 0.2),
               _row("lowrank s0.99 [6,12)", "lowrank", 0.5, 0.4)]


def test_scd_target_takes_the_fewest_bytes_within_tolerance():
    """int4 is no SCD config; s0.8 is below 95 % of full prefill; s0.9 (0.96 of it) at 0.2 x raw meets it."""
    t = bc.scd_target(TARGET_ROWS, "base->docqa", 1024)
    assert (t["chosen"], t["met"], t["bytes_vs_raw"]) == ("lowrank s0.9 [6,12)", True, 0.2)
    assert t["quality_vs_full"] == pytest.approx(0.96)
    t = bc.scd_target([r for r in TARGET_ROWS if r["config"] != "lowrank s0.9 [6,12)"], "base->docqa", 1024)
    assert (t["chosen"], t["met"]) == ("lowrank s0.99 [6,12)", False)  # within tolerance, but 0.4 x raw
    t = bc.scd_target(TARGET_ROWS[:4], "base->docqa", 1024)
    assert t["chosen"] is None and not t["met"] and "no lowrank" in t["why_none"]


def test_codecs_command_passes_its_options_and_reports_the_target(zoo, monkeypatch, tmp_path):
    """A real pair, --no-mesh and a codec list reach the run; the table and the JSON carry bytes
    vs raw, quality vs full prefill, the group and the SCD target."""
    from droidmesh.shared.tools.bench import codec_sweep

    seen = {}

    def fake(pairs, tokens, rates, repeats, rows, work, **kw):
        seen.update(pairs=pairs, tokens=tokens, rows=rows, **kw)
        return {"rows": TARGET_ROWS, "failures": [], "stage_seconds": {"quality base->docqa": 1.0}, "seconds": 2.0,
                "pairs": [{**pairs[0], "group": list(pairs[0]["group"]), "maps": {},
                           "calibration": {"contexts": 4, "tokens": 5000, "fit_s": 3.0},
                           "layout": {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "hidden": 576}}]}

    monkeypatch.setattr(codec_sweep, "run_codecs", fake)
    out = tmp_path / "codecs.json"
    res = CliRunner().invoke(cli.bench, ["codecs", "--pairs", "real/base:real/docqa", "--task", "doc_qa", "--no-mesh",
                                         "--codecs", "raw,int8,int4,scd", "--shares", "0.9,0.95", "--tokens", "1024",
                                         "--rows", "2", "--calibration-rows", "4", "--json", str(out),
                                         "--work-dir", str(tmp_path / "work")])
    assert res.exit_code == 0, res.output
    assert seen["over_mesh"] is False and seen["codecs"] == ["raw", "int8", "int4", "scd"]
    assert seen["shares"] == [0.9, 0.95] and seen["calibration_rows"] == 4 and seen["task"] == "doc_qa"
    assert seen["pairs"][0]["group"] == (6, 12) and seen["rows"] == 2 and seen["dtype"] == "bfloat16"
    assert "bytes_vs_raw" in res.output and "quality_vs_full" in res.output and "ttft_s" not in res.output
    assert "plan recompute [6,12)" in res.output and "30 layers, 3 KV heads x 64" in res.output
    assert "MET by lowrank s0.9 [6,12)" in res.output
    data = json.loads(out.read_text())
    assert data["scd_target"]["met"] is True and data["mesh"] is False and data["codecs"] == ["raw", "int8", "int4", "scd"]
    res = CliRunner().invoke(cli.bench, ["codecs", "--pairs", "real/base:real/docqa", "--task", "doc_qa", "--no-mesh",
                                         "--dtype", "float32", "--tokens", "1024", "--json", str(out),
                                         "--work-dir", str(tmp_path / "work")])
    assert res.exit_code == 0, res.output
    assert seen["dtype"] == "float32" and json.loads(out.read_text())["dtype"] == "float32"


@pytest.mark.parametrize("chosen,why", [
    ({"start": 0, "end": 0, "passes_test": True}, "chose full reuse"),
    ({"start": 6, "end": 12, "passes_test": False}, "fails its test split"),
])
def test_a_profile_that_chose_no_group_or_fails_its_test_is_not_the_codecs_group(zoo, chosen, why):
    """A saved profile that chose full reuse (an empty group, which no plan can recompute) or whose
    choice fails its test split gives way to the default group, and the source says why."""
    (zoo / "real" / "profiles").mkdir()
    (zoo / "real" / "profiles" / "base-to-docqa.json").write_text(json.dumps({"chosen": chosen}))
    [pair] = codecs_cli._codec_pairs("real/base:real/docqa")
    assert pair["group"] == tuple(codecs_cli.DEFAULT_GROUP) and why in pair["group_source"]
    (zoo / "real" / "profiles" / "base-to-docqa.json").write_text(json.dumps({"chosen": {"start": 3, "end": 9}}))
    assert codecs_cli._codec_pairs("real/base:real/docqa")[0]["group"] == (3, 9)
