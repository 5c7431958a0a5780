"""A profile's result as the config a sender and receivers read (`recompute_config`): the one
place a profile JSON becomes a `RecomputeConfig`.

Apart from `profile.py` (which runs the searches) so that what only publishes a saved profile (a
local mesh's control plane, the apps, the benches) does not import the searches and the task
scorers they score with (rapidfuzz, rouge-score, nltk): a GPU machine has none of those, and a
transfer or mesh check needs none.
"""

from __future__ import annotations

import time
from typing import Any

from droidmesh.shared.kv import policy
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.profiling import evidence
from droidmesh.shared.wire import schemas


def recompute_config(result: dict[str, Any], sender: ModelRef, receiver: ModelRef, version: int
                     ) -> schemas.RecomputeConfig:
    """The published config of a profile result (`run`'s JSON, fresh or read back from a file):
    the one place a profile becomes a `RecomputeConfig`."""

    def point(p: dict[str, Any], quality: str = "quality") -> schemas.FrontierPoint:
        plan = ReusePlan.recompute(p["start"], p["end"]) if p["end"] > p["start"] else ReusePlan.full_reuse()
        return schemas.FrontierPoint(plan=policy.spec_of(plan), recomputed_layers=p["end"] - p["start"],
                                     quality=p[quality])

    def coded(c: dict[str, Any]) -> schemas.FrontierPoint:
        plan = ReusePlan.recompute_groups(c["plan"]["groups"]).patched(c["plan"]["patch"])
        return schemas.FrontierPoint(plan=policy.spec_of(plan, c["codec"], c["codec_params"]),
                                     recomputed_layers=c["recomputed_layers"], quality=c["quality_train"],
                                     wire_bytes_per_token=c["wire_bytes_per_token"])

    # The transfer search's configs meeting the rule, sent coded: a receiver picks among them by
    # its measured bandwidth (raw ones are the group search's points already).
    extra = [coded(c) for c in (result.get("transfer") or {}).get("configs", []) if c["meets_rule"] and c["codec"] != "raw"]

    fit = result.get("latency_fit")
    # The test split's check travels with the config (recomputed, not read: a profile JSON
    # written before the check existed has both qualities too).
    chosen_test, full_prefill_test = result["chosen"].get("quality_test"), result["full_prefill"].get("quality_test")
    interval = result["chosen"].get("test_interval")
    passes = (evidence.PASSES[interval["verdict"]] if interval else None if chosen_test is None or full_prefill_test is None
              else evidence.passes_test(chosen_test, full_prefill_test, result["tolerance"]))
    return schemas.RecomputeConfig(
        sender_model=sender.name, receiver_model=receiver.name, sender_sha256=sender.sha256,
        receiver_sha256=receiver.sha256, profile_version=version, task=result["task"],
        tolerance=result["tolerance"], chosen=point(result["chosen"], "quality_train"),
        frontier=[point(p) for p in result["frontier"]] + extra, full_prefill_quality=result["full_prefill"]["quality_train"],
        full_reuse_quality=result["full_reuse"]["quality_train"], total_layers=result["total_layers"],
        latency=schemas.LatencyFit(**fit) if fit else None, created_at=time.time(),
        chosen_quality_test=chosen_test, full_prefill_quality_test=full_prefill_test, passes_test=passes,
        test_rows=interval["rows"] if interval else None,
        test_interval=[interval["rel_lo"], interval["rel_hi"]] if interval and interval["rel_lo"] is not None else None,
        test_verdict=interval["verdict"] if interval else None,
    )
