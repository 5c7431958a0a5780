"""The relay policy: per reusable-prefix bucket, whether relaying KV pays, as the relay audit
(`estimate`) found it, and that verdict carried by the published pair configs.

Called by `shared/tools/cli/audit.py` (`policy_proposal`: the policy file from an audit result),
`shared/tools/cli/config.py` (`relay_buckets`, `with_relay`: `droidmesh config relay-policy FILE`
writes the buckets into the newest pair configs, `RecomputeConfig.relay`, which receivers load
hot), `shared/tools/cli/agents.py` and `shared/tools/cli/bench/` (`read_relay_policy`), and the receiver
(`reusable_bucket`: the stratum its dashboard counts requests by). Nothing here blocks beyond
reading one file. A policy file is not trusted: `relay_buckets` checks it before any of it is used.

Policy file (`droidmesh audit --policy OUT.json`):

    {
      "schema": "droidmesh.audit.policy/1",
      "generated_from": {"files": 3, "requests_used": 812, "bootstrap": 2000, "seed": 0, "ci_level": 0.95},
      "buckets": [                                   # reusable-prefix fraction buckets, highest first
        {"label": "[0.95,1]", "reusable_fraction": [0.95, 1.0],
         "relay": true,                              # true: CI upper bound < 0 (relaying significantly faster)
                                                     # false: CI lower bound > 0 (significantly slower)
                                                     # null: undecided (CI spans 0, or < 5 requests in an arm)
         "evidence": "blind",                        # the arm against the control: "blind" (relaying itself,
                                                     # when it has >= 5 requests) or "treatment" (the policy)
         "ate_ttft_s": -0.21, "ci_low": -0.25, "ci_high": -0.17, "treatment": 300, "control": 40},
        ...
      ],
      "min_reusable_fraction": 0.85                  # lower bound of the lowest bucket of the run of
    }                                                # relay=true buckets from the top; null if [0.95,1] is not true
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.mesh.config_board import MAX_RELAY_BUCKETS
from droidmesh.shared.wire.schemas import RecomputeConfig, RelayBucket

MIN_POLICY_ARM = 5  # a bucket's relay decision needs this many treatment and control requests
POLICY_SCHEMA = "droidmesh.audit.policy/1"
# (label, low, high): reusable fraction in [low, high); the top bucket includes 1.
REUSABLE_BUCKETS = (("[0.95,1]", 0.95, math.inf), ("[0.85,0.95)", 0.85, 0.95), ("[0.7,0.85)", 0.7, 0.85), ("<0.7", 0.0, 0.7))


def bucket_label(buckets: Sequence[tuple[str, float, float]], x: float | None) -> str | None:
    """The label of the (label, low, high) bucket holding `x` in [low, high), or None."""
    if x is None:
        return None
    return next((label for label, lo, hi in buckets if lo <= x < hi), None)


def reusable_bucket(fraction: float) -> str:
    """The reusable-prefix stratum of a fraction in [0, 1] (the dashboard counts by it too)."""
    return bucket_label(REUSABLE_BUCKETS, max(0.0, fraction)) or REUSABLE_BUCKETS[-1][0]


def relay_decision(row: dict[str, Any], arm: str = "treatment") -> bool | None:
    """True where relaying (`arm` "treatment": as the policy chose; "blind": always) is
    significantly faster than the control (CI < 0), False where slower (CI > 0), else None (also
    with fewer than MIN_POLICY_ARM requests in an arm: a bootstrap of a handful says little)."""
    pre = "" if arm == "treatment" else f"{arm}_"
    if min(row[arm], row["control"]) < MIN_POLICY_ARM:
        return None
    if row[f"{pre}ci_high"] is not None and row[f"{pre}ci_high"] < 0:
        return True
    if row[f"{pre}ci_low"] is not None and row[f"{pre}ci_low"] > 0:
        return False
    return None


def policy_proposal(result: dict[str, Any]) -> dict[str, Any]:
    """The policy file (schema in the module docstring) from an `estimate.audit` result."""
    by_name = {r["stratum"]: r for r in result["strata"]}
    buckets, floor, run = [], None, True
    for label, lo, hi in REUSABLE_BUCKETS:
        row = by_name[f"reusable={label}"]
        # Blind relay measures relaying itself (also where a veto stopped the policy): its
        # verdict wins once it has the requests; else the policy's own arm.
        arm = "blind" if min(row["blind"], row["control"]) >= MIN_POLICY_ARM else "treatment"
        relay = relay_decision(row, arm)
        run = run and relay is True
        floor = lo if run else floor
        pre = "" if arm == "treatment" else "blind_"
        buckets.append({"label": label, "reusable_fraction": [lo, min(hi, 1.0)], "relay": relay, "evidence": arm,
                        "ate_ttft_s": row[f"{pre}ate_ttft_s"], "ci_low": row[f"{pre}ci_low"],
                        "ci_high": row[f"{pre}ci_high"], "treatment": row[arm], "control": row["control"]})
    return {"schema": POLICY_SCHEMA,
            "generated_from": {k: result[k] for k in ("files", "requests_used", "bootstrap", "seed", "ci_level")},
            "buckets": buckets, "min_reusable_fraction": floor}


def read_relay_policy(path: str | Path) -> list[RelayBucket]:
    """The buckets of the policy file at `path` (`BadRequestError` for one that is not JSON or not a policy)."""
    try:
        policy = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequestError(f"{path} is not JSON ({e})") from None
    return relay_buckets(policy, str(path))


def relay_buckets(policy: Any, where: str = "the policy file") -> list[RelayBucket]:
    """The relay buckets of a policy file (as `policy_proposal` writes it), checked: the schema,
    at most MAX_RELAY_BUCKETS buckets, each fraction range inside [0, 1] and relay true/false/null.
    Raises `BadRequestError` naming the first problem."""
    if not isinstance(policy, dict) or policy.get("schema") != POLICY_SCHEMA:
        raise BadRequestError(f"{where} is not a relay policy (schema {POLICY_SCHEMA!r})")
    raw = policy.get("buckets")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_RELAY_BUCKETS:
        raise BadRequestError(f"{where}: buckets must be a list of 1 to {MAX_RELAY_BUCKETS}")
    out = []
    for i, b in enumerate(raw):
        rng = b.get("reusable_fraction") if isinstance(b, dict) else None
        relay = b.get("relay") if isinstance(b, dict) else None
        if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int | float) for x in rng)
                and 0 <= rng[0] < rng[1] <= 1) or relay not in (True, False, None):
            raise BadRequestError(f"{where}: bucket {i} needs reusable_fraction [lo, hi] with 0 <= lo < hi <= 1 "
                                  f"and relay true, false or null")
        out.append(RelayBucket(lo=float(rng[0]), hi=float(rng[1]), relay=relay))
    return out


def with_relay(cfg: RecomputeConfig, buckets: list[RelayBucket], version: int) -> RecomputeConfig:
    """`cfg` carrying the audit's `buckets` as `version`. An undecided bucket (relay null) keeps the
    verdict `cfg` already had for the same range: once a bucket is vetoed its requests are no longer
    relayed, so a later audit cannot see relaying there and would otherwise lift the veto."""
    before = {(b.lo, b.hi): b for b in cfg.relay}
    merged = [b if b.relay is not None else before.get((b.lo, b.hi), b) for b in buckets]
    return msgspec.structs.replace(cfg, relay=merged, profile_version=version, created_at=time.time())
