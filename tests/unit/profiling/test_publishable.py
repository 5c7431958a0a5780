"""The one rule a config passes before anything publishes it (`evidence.check_publishable`):
`droidmesh config publish` and the profiler service both apply it."""

from __future__ import annotations

import msgspec
import pytest

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.profiling import evidence
from droidmesh.shared.wire.schemas import FrontierPoint, PlanSpec, RecomputeConfig

POINT = FrontierPoint(PlanSpec(groups=[(2, 4)]), 2, 0.9)
CFG = RecomputeConfig(sender_model="s", receiver_model="r", sender_sha256="a" * 64, receiver_sha256="b" * 64,
                      profile_version=1, task="qa", tolerance=0.05, chosen=POINT, frontier=[POINT],
                      full_prefill_quality=1.0, full_reuse_quality=0.5, total_layers=6)


def test_a_plan_whose_test_interval_lies_below_the_rule_is_refused_with_the_interval():
    failing = msgspec.structs.replace(CFG, passes_test=False, test_verdict="below", test_interval=[-0.4, -0.2],
                                      test_rows=200)
    with pytest.raises(BadRequestError) as e:
        evidence.check_publishable(failing, "s -> r", "not published")
    assert str(e.value) == ("s -> r: the chosen plan FAILS on test: [-40.0%, -20.0%] against full prefill, 95 % over "
                            "200 rows, rule -5%; not published")


def test_a_profile_without_per_row_scores_is_judged_on_its_means():
    failing = msgspec.structs.replace(CFG, passes_test=False, chosen_quality_test=0.8, full_prefill_quality_test=0.9)
    assert evidence.unpublishable(failing) == "the chosen plan fails the test split (test 0.800 < 0.95 x full prefill 0.900)"


@pytest.mark.parametrize("fields", [
    {},  # made before the check: no test qualities
    {"passes_test": None, "test_verdict": "undecided", "test_interval": [-0.1, 0.02], "test_rows": 40},
    {"passes_test": True, "test_verdict": "within", "test_interval": [-0.01, 0.02], "test_rows": 40},
])
def test_an_undecided_passing_or_unchecked_plan_is_publishable(fields):
    cfg = msgspec.structs.replace(CFG, **fields)
    assert evidence.unpublishable(cfg) is None
    evidence.check_publishable(cfg, "s -> r", "not published")
