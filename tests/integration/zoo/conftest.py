"""One ci-tier build per test session (the build is deterministic and takes well under a minute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared.zoo import build_tier


@pytest.fixture(scope="session")
def ci_tier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(directory, manifest) of a fresh ci-tier build."""
    out = tmp_path_factory.mktemp("zoo") / "ci"
    return out, build_tier("ci", out)
