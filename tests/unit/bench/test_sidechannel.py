"""`bench sidechannel`: the attacker's threshold, the Wilson interval, the train/test split, and
the command's table and JSON (no mesh: a stubbed run)."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from droidmesh.shared.tools.bench import sidechannel as sc
from droidmesh.shared.tools.cli import bench as cli
from droidmesh.shared.tools.cli.bench import mesh as mesh_cli


def test_the_threshold_separates_separable_times_in_either_direction():
    times = [0.5, 0.6, 0.55, 1.2, 1.3, 1.25]
    cached = [True, True, True, False, False, False]
    rule = sc.train_threshold(times, cached)
    assert rule["train_accuracy"] == 1.0 and rule["faster_is_cached"] and 0.6 < rule["threshold_s"] < 1.2
    slower = sc.train_threshold(times, [not c for c in cached])  # if cached were slower, the rule flips
    assert slower["train_accuracy"] == 1.0 and not slower["faster_is_cached"]


def test_the_split_is_stratified_and_disjoint():
    cached = [True] * 10 + [False] * 10
    train, test = sc.split(cached, seed=3)
    assert not set(train) & set(test) and len(train) + len(test) == 20
    assert sum(cached[i] for i in train) == 5 and sum(cached[i] for i in test) == 5


def test_distinguishable_times_are_caught_and_identical_distributions_are_at_chance():
    rng = np.random.default_rng(0)
    n = 200
    fast, slow = rng.normal(0.5, 0.05, n), rng.normal(1.2, 0.05, n)
    leak = sc.evaluate(np.concatenate([fast, slow]).tolist(), [True] * n + [False] * n, seed=1)
    assert leak["accuracy"] > 0.95 and not leak["chance_in_ci"] and leak["ci95"][0] > 0.9
    same = rng.normal(1.2, 0.05, 2 * n)
    blind = sc.evaluate(same.tolist(), [True] * n + [False] * n, seed=1)
    assert blind["chance_in_ci"] and blind["ci95"][0] < 0.5 < blind["ci95"][1]
    assert blind["test_trials"] == n and blind["test_correct"] == round(blind["accuracy"] * n)


def test_the_command_prints_both_phases_and_writes_json(tmp_path, monkeypatch):
    def fake_run(setup, tokens, trials, warmup, seed, say):
        assert (tokens, trials, warmup, setup.group, setup.holding) == (500, 6, 0, (4, 6), False)
        phases = {}
        for name, tenant, gap in (("before", sc.VICTIM, 1.0), ("after", sc.ATTACKER, 0.0)):
            times = [0.5 + gap * (i % 2) + 0.01 * i for i in range(2 * trials)]
            rows = [{"cached": i % 2 == 0, "seconds": t, "path": None, "prompt_tokens": tokens}
                    for i, t in enumerate(times)]
            ev = sc.evaluate([r["seconds"] for r in rows], [r["cached"] for r in rows], seed)
            phases[name] = {"attacker_tenant": tenant, **ev, "paths": {}, "prompt_tokens": tokens, "trials": rows}
        return {"phases": phases}

    monkeypatch.setattr(sc, "run_sidechannel", fake_run)
    monkeypatch.setattr(mesh_cli, "demo_pair", lambda: ("s", "r"))
    monkeypatch.setattr(mesh_cli, "checkpoint_layers", lambda path: 12)  # the demo receiver's layers
    out = CliRunner().invoke(cli.bench, ["sidechannel", "--tokens", "500", "--trials", "6", "--warmup", "0",
                                         "--json", str(tmp_path / "sc.json")])
    assert out.exit_code == 0, out.output
    assert "before: accuracy 1.000" in out.output and "excludes 0.5" in out.output
    saved = json.loads((tmp_path / "sc.json").read_text())
    assert saved["suite"] == "sidechannel" and set(saved["phases"]) == {"before", "after"}
    assert saved["phases"]["before"]["accuracy"] == 1.0 and not saved["phases"]["before"]["chance_in_ci"]
