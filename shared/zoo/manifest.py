"""Where built tiers live and what their manifests say: `droidmesh zoo list`, and the tier
directories `shared.zoo.manifest.resolve_model` searches.

Tier directories are searched in order: $DROIDMESH_ZOO_DIR/<tier> (or the user cache dir),
then the repository's committed `zoo/<tier>`; tiers in the order demo, ci, family, real,
real-family. A model is named `<tier>/<name>` (or `<name>`: the first tier that has it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.errors import CheckpointNotFoundError
from droidmesh.shared.model.names import ModelRef, Pair, is_checkpoint, local_path

MANIFEST = "manifest.json"
REPO_ZOO = ZOO_DIR  # the demo tier ships in the package (in a checkout: the repository's zoo/)
TIER_ORDER = ("demo", "ci", "family", "real", "real-family")


def zoo_dir(tier: str) -> Path:
    """Default directory of a tier: $DROIDMESH_ZOO_DIR/<tier>, else ~/.cache/droidmesh/zoo/<tier>."""
    root = os.environ.get("DROIDMESH_ZOO_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "droidmesh" / "zoo"
    return base / tier


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    p = Path(out_dir) / MANIFEST
    return json.loads(p.read_text()) if p.is_file() else None


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


def profile_file(tier_dir: Path, pair: Pair, suffix: str = ".json") -> Path:
    """Where a tier keeps a pair's saved `droidmesh profile` output (`.json`, `.png`)."""
    return tier_dir / "profiles" / f"{pair.id}{suffix}"


def servable_profiles(tier_dir: Path, pairs: Iterable[Pair], say: Callable[[str], None] = lambda s: None
                      ) -> dict[str, dict[str, Any]]:
    """Pair id -> its saved profile, for the pairs a local mesh (demo, agents) serves by profile. A
    profile whose choice fails its test split is left out (with a line through `say`), as
    `droidmesh config publish` refuses it: such a pair is served on the default group instead."""
    out = {}
    for p in pairs:
        f = profile_file(tier_dir, p)
        if not f.is_file():
            continue
        prof = json.loads(f.read_text())
        if prof.get("chosen", {}).get("passes_test") is False:
            say(f"{p.id}: its profile's choice fails the test split; serving the default group instead")
            continue
        out[p.id] = prof
    return out


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
            pairs.append({"tier": tier, "kind": "reuse", "sender": f"{tier}/{p['sender']}",
                          "receiver": f"{tier}/{p['receiver']}", "task": p["task"], "id": Pair(p["sender"], p["receiver"]).id})
        for p in man.get("translate_pairs", []):  # source -> target of another size, family or tokenizer
            source, target = (n if "/" in n else f"{tier}/{n}" for n in (p["source"], p["target"]))
            pairs.append({"tier": tier, "kind": "translate", "sender": source, "receiver": target, "task": p["task"],
                          "id": Pair(source.rpartition("/")[2], target.rpartition("/")[2]).id,
                          "translator": p.get("translator"), "translator_sha256": p.get("translator_sha256")})
    return {"models": models, "pairs": pairs}


def tier_models(root: Path, manifest: dict) -> dict[str, ModelRef]:
    """Every model of a built zoo tier (its directory and manifest), by name."""
    return {name: ModelRef(root / m["path"], name, manifest["tier"], m["sha256"]) for name, m in manifest["models"].items()}


def resolve_model(arg: str, name: str | None = None) -> ModelRef:
    """A local checkpoint path or a zoo model name -> ModelRef; `name` overrides the model id.
    Raises CheckpointNotFoundError (commands turn it into a one-line usage error)."""
    p = local_path(arg)
    if is_checkpoint(p):
        return ModelRef(p, name or p.resolve().name)
    tier_hint, _, short = arg.rpartition("/")
    for tier, d, man in find_tiers():
        if tier_hint in ("", tier) and short in man["models"]:
            m = man["models"][short]
            return ModelRef(d / m["path"], name or short, tier, m.get("sha256"))
    raise CheckpointNotFoundError(
        f"{arg!r} is neither a local checkpoint (a directory with config.json) nor a built zoo model; "
        f"see `droidmesh zoo list`, or run `droidmesh zoo build --tier demo`")
