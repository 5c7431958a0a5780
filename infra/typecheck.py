"""Type-check DroidMesh under the module names it installs as: `shared/` is `droidmesh.shared`.

The design keeps `shared/` and `services/` at the repository's top and `pyproject.toml` maps them
into the `droidmesh` namespace. mypy derives a module's name from its path, so `mypy shared`
would name `shared/kv/policy.py` `shared.kv.policy` and every `droidmesh.shared...` import would
lead nowhere (silently, with `ignore_missing_imports`). This script hands mypy each file with the
name `pyproject.toml`'s mapping gives it (mypy's own build API, the same settings from
`[tool.mypy]`), so every import between our modules resolves and is checked.

Usage: python infra/typecheck.py   (exit status 1 on any error, like mypy)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def sources() -> list[BuildSource]:
    """Every Python file of every mapped package, named as the installed module."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for package, folder in sorted(mapping.items()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append(BuildSource(str(path), ".".join((package, *parts)), None))
    return found


def main() -> int:
    # process_options reads [tool.mypy]; the file list it wants is replaced by our own sources.
    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "shared")])
    srcs = sources()
    try:
        result = build.build(sources=srcs, options=options)
    except CompileError as e:
        print("\n".join(e.messages), file=sys.stderr)
        return 2
    for line in result.errors:
        print(line)
    if result.errors:
        print(f"Found {sum(': error:' in m for m in result.errors)} errors in {len(srcs)} source files")
        return 1
    print(f"Success: no issues found in {len(srcs)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
