"""`droidmesh profile` on tiny random checkpoints: the cost said first, --budget, rows with no signal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.profiling import cost
from droidmesh.shared.tools.cli.main import main


def profile(pair: tuple[Path, Path], out: Path, *extra: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of a 2 + 2 row profile of the tiny pair (multihop_qa rows)."""
    argv = ["profile", "--sender", str(pair[0]), "--receiver", str(pair[1]), "--task", "multihop_qa", "--n-train", "2",
            "--n-test", "2", "--no-robustness", "--no-transfer", "--json", str(out), *extra]
    res = CliRunner().invoke(main, argv, env={"DM_DEBUG": "", "OMP_NUM_THREADS": "1"})
    return res.exit_code, res.stdout, [line for line in res.stderr.splitlines() if line.strip()]


def test_rows_the_receiver_scores_zero_on_fail_after_the_cost_is_said(tiny_pair, tmp_path):
    """A random receiver's full prefill scores 0 on the task's rows: one `Error:` line (exit 1),
    no profile written; the cost line came first, with the measured time per row-evaluation."""
    code, _, err = profile(tiny_pair, tmp_path / "p.json")
    assert code == 1, err
    announced = [line for line in err if line.startswith("profile: ~")]
    assert len(announced) == 1 and "evaluations × 2 rows" in announced[0] and "measured per row: full prefill" in announced[0]
    assert err[-1].startswith("Error: the receiver's own full prefill scores 0.000 on the train rows")
    assert sum(line.startswith("Error") for line in err) == 1 and "Traceback" not in "\n".join(err)
    assert err.index(announced[0]) < len(err) - 1 and not (tmp_path / "p.json").exists()


def test_a_budget_nothing_fits_is_refused_before_the_profile(tiny_pair, tmp_path):
    code, _, err = profile(tiny_pair, tmp_path / "p.json", "--budget", "0.0001", "--allow-no-signal")
    assert code == 2 and err[-1].startswith("Error: --budget 0.0001 min is too short"), err
    assert not any(line.startswith("profile: ~") for line in err) and not (tmp_path / "p.json").exists()


def test_a_budget_cuts_the_work_and_the_profile_records_it(tiny_pair, tmp_path, monkeypatch):
    """The measured times pinned, a budget that holds the guided search but not the
    exhaustive comparison: the comparison is cut, said on stderr, recorded in the JSON."""
    timing = cost.Timing(1.0, 0.5, 0.25)
    monkeypatch.setattr(cost, "measure", lambda *args: timing)
    monkeypatch.setattr(cost, "typical_row", lambda rows, length: (rows[0], 1.0))  # the timing as pinned
    layers = 6  # the tiny pair's
    fits = cost.seconds(cost.Work("guided", False, 2, 2), layers, 2, timing)
    code, out, err = profile(tiny_pair, tmp_path / "p.json", "--exhaustive", "--allow-no-signal", "--budget",
                             f"{fits / 60 + 1e-6:.6f}")
    assert code == 0, err
    assert any(line.startswith("profile: cut to fit --budget") and "the exhaustive comparison" in line for line in err)
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["evaluations"]["exhaustive"] == 0 and p["cost"]["cut"] == ["the exhaustive comparison"]
    assert p["cost"]["estimated_s"] == pytest.approx(fits) and p["cost"]["measured_s"]["full_s"] == 1.0
    assert "guided search" in out and "undecided on test: no interval (full prefill scores 0)" in out  # nothing to keep


def test_without_a_budget_the_profile_fits_an_hour(tiny_pair, tmp_path, monkeypatch):
    """No --budget given: the measured times pinned so that the guided search fits an hour and the
    exhaustive comparison does not, the comparison is cut as `--budget 60` would cut it, and the
    announced cost is within the hour; `--budget 0` runs everything asked for."""
    layers = 6  # the tiny pair's
    unit = cost.Timing(1.0, 0.5, 0.25)
    fits = cost.seconds(cost.Work("guided", False, 2, 2), layers, 2, unit)
    timing = cost.Timing(*(t * 3600 / fits * (1 - 1e-6) for t in (unit.full_s, unit.reuse_s, unit.capture_s)))
    monkeypatch.setattr(cost, "measure", lambda *args: timing)
    monkeypatch.setattr(cost, "typical_row", lambda rows, length: (rows[0], 1.0))  # the timing as pinned
    code, _, err = profile(tiny_pair, tmp_path / "p.json", "--exhaustive", "--allow-no-signal")
    assert code == 0, err
    assert any(line.startswith("profile: cut to fit --budget 60 min (--budget 0: no limit)") and
               "the exhaustive comparison" in line for line in err), err
    p = json.loads((tmp_path / "p.json").read_text())["cost"]
    assert p["budget_s"] == 3600 and p["cut"] == ["the exhaustive comparison"] and p["estimated_s"] <= 3600
    code, _, err = profile(tiny_pair, tmp_path / "q.json", "--exhaustive", "--allow-no-signal", "--budget", "0")
    assert code == 0 and not any(line.startswith("profile: cut") for line in err), err
    q = json.loads((tmp_path / "q.json").read_text())["cost"]
    assert q["budget_s"] is None and q["cut"] == [] and q["estimated_s"] > 3600


def test_publish_refuses_a_choice_that_fails_the_test_split(tmp_path, monkeypatch):
    """`--publish` after a profile whose choice fails the test split: the JSON is written and
    marked, the warning names the rule, nothing is published (no NATS runs here) and the one
    `Error:` line points at `config publish --force`."""
    from droidmesh.shared.profiling import profile as profiling
    from droidmesh.shared.profiling.profile import ProfileSettings, recompute_config, run
    from droidmesh.shared.zoo.manifest import resolve_model

    def train(plan):
        return 1.0 if plan.mode == "full_prefill" else 0.96

    def test(plan):
        return 1.0 if plan.mode == "full_prefill" else 0.5

    def fake(sender, receiver, task, settings, **kw):
        result = run(train, test, 4, ProfileSettings(), pair=profiling.Pair(sender.name, receiver.name, task))
        result.update(rows={"train": 20, "test": 20}, cost={"elapsed_s": 1.0, "estimated_s": 1.0})
        return result, recompute_config(result, resolve_model("demo/base"), resolve_model("demo/qa"), 1)

    monkeypatch.setattr(profiling, "profile_checkpoints", fake)
    argv = ["profile", "--sender", "demo/base", "--receiver", "demo/qa", "--task", "multihop_qa", "--json",
            str(tmp_path / "p.json"), "--publish", "--nats", "nats://127.0.0.1:9", "--timeout", "1"]
    res = CliRunner().invoke(main, argv, env={"DM_DEBUG": ""})
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 1 and err[-1].startswith("Error: not published: the chosen plan fails the test split"), err
    assert "config publish --force" in err[-1] and any("fails the 5% rule on the test split" in line for line in err)
    assert json.loads((tmp_path / "p.json").read_text())["chosen"]["passes_test"] is False
    assert "FAILS on test" in res.stdout
