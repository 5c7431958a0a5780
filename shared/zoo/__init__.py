"""DroidMesh model zoo: small Llama families trained here, and the synthetic task data they learn.

`build_tier(tier, out_dir)` builds (or reuses) a tier; see `shared/zoo/tiers.py` for recipes.
"""

from __future__ import annotations

from typing import Any


def build_tier(tier: str, out_dir: Any = None, **kw: Any) -> dict[str, Any]:
    """Build (or reuse a cached) zoo tier; return its manifest. Imported lazily (torch)."""
    from droidmesh.shared.zoo.build import build_tier as _build

    return _build(tier, out_dir, **kw)


__all__ = ["build_tier"]
