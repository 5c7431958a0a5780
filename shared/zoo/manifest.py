"""Finding built tiers and naming their models: `droidmesh zoo list` and model-name resolution.

Tier directories are searched in order: $DROIDMESH_ZOO_DIR/<tier> (or the user cache dir),
then the repository's committed `zoo/<tier>`. A model is named `<name>` (first tier that has
it, demo before ci) or `<tier>/<name>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.errors import CheckpointNotFoundError
from shared.zoo.build import read_manifest, zoo_dir

REPO_ZOO = Path(__file__).resolve().parents[2] / "zoo"
TIER_ORDER = ("demo", "ci")


def tier_dirs(tier: str) -> list[Path]:
    return [zoo_dir(tier), REPO_ZOO / tier]


def find_tiers() -> list[tuple[str, Path, dict[str, Any]]]:
    """(tier, directory, manifest) for every built tier found, first location per tier wins."""
    found = []
    for tier in TIER_ORDER:
        for d in tier_dirs(tier):
            man = read_manifest(d)
            if man is not None:
                found.append((tier, d, man))
                break
    return found


def listing() -> dict[str, Any]:
    """`zoo list --json`: models (path, tier, parent, fine-tuned for what) and intended pairs."""
    models, pairs = [], []
    for tier, d, man in find_tiers():
        for name, m in sorted(man["models"].items()):
            models.append({
                "name": f"{tier}/{name}", "tier": tier, "path": str((d / m["path"]).resolve()), "kind": m["kind"],
                "parent": None if m["parent"] is None else f"{tier}/{m['parent']}", "fine_tuned_for": m["task"],
                "layers": m["layers"], "sha256": m["sha256"],
            })
        for p in man["pairs"]:
            pairs.append({"tier": tier, "sender": f"{tier}/{p['sender']}", "receiver": f"{tier}/{p['receiver']}", "task": p["task"]})
    return {"models": models, "pairs": pairs}


def resolve_model(name_or_path: str) -> tuple[Path, str | None]:
    """A local checkpoint path, or a zoo model name -> (path, tier or None)."""
    p = Path(name_or_path).expanduser()
    if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
        return p, None
    tier_hint, _, name = name_or_path.rpartition("/")
    for tier, d, man in find_tiers():
        if tier_hint and tier_hint != tier:
            continue
        if name in man["models"]:
            return d / man["models"][name]["path"], tier
    raise CheckpointNotFoundError(
        f"{name_or_path!r} is neither a local checkpoint nor a built zoo model; "
        f"run `droidmesh zoo build --tier demo` or see `droidmesh zoo list`"
    )
