"""The pair configs `droidmesh serve` publishes, and the config files `droidmesh config publish` reads.

Called on the CLI's main thread before any process starts (`droidmesh serve` gathers what to
publish; `droidmesh config publish` validates a file); blocking file reads only, nothing connects.
A file is trusted to be what its user points at, not to be well formed: `load_config` validates
it in full (`BadRequestError`, one line) and `maps_files` checks each maps file against its sha256.
`zoo_profiles` and `bind` match a config to the served models by the sha256 of their weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from droidmesh.shared.errors import BadRequestError, DroidMeshError
from droidmesh.shared.model.names import Pair
from droidmesh.shared.wire import schemas

if TYPE_CHECKING:  # serve imports this module: its plan types are only annotations here
    from droidmesh.shared.tools.apps.serve import Served, ServePlan

PROFILE_KEYS = ("sender", "receiver", "task", "tolerance", "total_layers", "chosen", "frontier", "full_prefill",
                "full_reuse")


@dataclasses.dataclass(frozen=True)
class Published:
    """A pair config to put on the board, with the SCD maps files its plans name (sha256 -> bytes)."""

    cfg: schemas.RecomputeConfig
    maps: dict[str, bytes] = dataclasses.field(default_factory=dict)

    @property
    def pair(self) -> str:
        return Pair(self.cfg.sender_model, self.cfg.receiver_model).id

    @property
    def plan(self) -> str:
        groups = self.cfg.chosen.plan.groups
        return "recompute " + ",".join(f"[{s},{e})" for s, e in groups) if groups else "full reuse"


def read_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`; `BadRequestError` for anything else."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestError(f"{path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _from_profile(path: str, data: dict[str, Any], sender: str | None, receiver: str | None,
                  version: int) -> schemas.RecomputeConfig:
    from droidmesh.shared.profiling.published import recompute_config
    from droidmesh.shared.zoo.manifest import resolve_model

    missing = [k for k in PROFILE_KEYS if k not in data]
    if missing:
        raise BadRequestError(f"{path} is neither a RecomputeConfig nor a profile (missing {', '.join(missing)})")
    # The config binds the weights' sha256s: resolve the models the profile names (`models`: the
    # zoo label or path `droidmesh profile` recorded, else the bare ids), unless overridden.
    recorded = data.get("models")
    models: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    s_ref = resolve_model(sender or str(models.get("sender") or data["sender"]))
    r_ref = resolve_model(receiver or str(models.get("receiver") or data["receiver"]))
    try:
        cfg = recompute_config(data, s_ref, r_ref, version)
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as e:  # a malformed frontier point, say
        raise BadRequestError(f"{path}: not a valid profile ({type(e).__name__}: {e})") from None
    for role, ref in (("sender", s_ref), ("receiver", r_ref)):
        profiled = models.get(f"{role}_sha256")
        if profiled and profiled != ref.sha256:
            raise BadRequestError(f"{path} profiled other {role} weights than {ref.label} holds now "
                                  f"(sha256 {profiled[:12]} vs {ref.sha256[:12]}); profile it again")
    return cfg


def load_config(path: str, sender: str | None = None, receiver: str | None = None,
                version: int | None = None) -> schemas.RecomputeConfig:
    """The validated RecomputeConfig a file holds (a profile JSON or a RecomputeConfig JSON)."""
    from droidmesh.shared.mesh.config_board import validate

    data = read_json(path)
    if data.get("type") == "recompute.config" or "sender_model" in data:
        if sender or receiver:
            raise BadRequestError("--sender / --receiver apply to a profile JSON; a RecomputeConfig names its models")
        try:
            cfg = msgspec.convert({"type": "recompute.config", **data}, schemas.RecomputeConfig)
        except msgspec.ValidationError as e:
            raise BadRequestError(f"{path}: invalid RecomputeConfig: {e}") from None
        if version is not None:
            cfg = msgspec.structs.replace(cfg, profile_version=version)
    else:
        cfg = _from_profile(path, data, sender, receiver, version if version is not None else int(time.time()))
    try:
        return validate(cfg)
    except DroidMeshError as e:
        raise BadRequestError(f"{path}: {e}") from None


def maps_files(path: str, cfg: schemas.RecomputeConfig) -> dict[str, bytes]:
    """The maps files `cfg` names, read from maps/<sha256>.safetensors next to `path` and checked
    against their names; `BadRequestError` for one missing or altered."""
    from droidmesh.shared.mesh.maps_store import referenced

    found = {}
    for sha in sorted(referenced([*cfg.frontier, cfg.chosen])):
        f = Path(path).parent / "maps" / f"{sha}.safetensors"
        if not f.is_file():
            raise BadRequestError(f"{path} names SCD maps {sha[:12]}...; {f} is missing")
        data = f.read_bytes()
        if hashlib.sha256(data).hexdigest() != sha:
            raise BadRequestError(f"{f} does not hash to its name: altered or truncated")
        found[sha] = data
    return found


def zoo_profiles(plan: ServePlan) -> list[tuple[Served, Served, Path]]:
    """(sender, receiver, profile file) for each ordered pair of served zoo models of one tier whose
    tier saved a `droidmesh profile` result for it."""
    from droidmesh.shared.zoo.manifest import find_tiers, profile_file

    dirs = {tier: d for tier, d, _ in find_tiers()}
    out = []
    for s in plan.models:
        for r in plan.models:
            tier = s.ref.tier
            if s is r or tier is None or tier != r.ref.tier or tier not in dirs:
                continue
            f = profile_file(dirs[tier], Pair(s.ref.name, r.ref.name))
            if f.is_file():
                out.append((s, r, f))
    return out


def bind(cfg: schemas.RecomputeConfig, plan: ServePlan) -> schemas.RecomputeConfig | None:
    """`cfg` for the served models whose weights it was profiled on (by sha256; the first served
    of equal weights), renamed to their served ids; None when the pair is not among them."""
    by_sha: dict[str, str] = {}
    for m in plan.models:
        by_sha.setdefault(m.ref.sha256, m.id)
    s, r = by_sha.get(cfg.sender_sha256), by_sha.get(cfg.receiver_sha256)
    if s is None or r is None or s == r:
        return None
    return renamed(cfg, s, r)


def renamed(cfg: schemas.RecomputeConfig, sender: str, receiver: str) -> schemas.RecomputeConfig:
    return msgspec.structs.replace(cfg, sender_model=sender, receiver_model=receiver)
