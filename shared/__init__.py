"""DroidMesh's library: everything the services, the CLI and the benchmarks share.

Installed as `droidmesh.shared` (the repository's `shared/`, mapped in `pyproject.toml`); the
services are `droidmesh.services`. Two data packages travel with it: the NATS configuration
(`droidmesh.nats_config`, the repository's `infra/nats`) and the demo tier of the zoo
(`droidmesh.zoo`, the repository's `zoo/`), found through the import system so a wheel works
outside a checkout and an editable install reads the checkout's own files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__version__ = importlib.metadata.version("droidmesh")  # pyproject.toml's, as installed


def _data_dir(package: str) -> Path:
    """The folder of a data package (a namespace package: no `__init__.py`, one location)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"DroidMesh's data package {package} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


NATS_CONFIG_DIR = _data_dir("droidmesh.nats_config")
ZOO_DIR = _data_dir("droidmesh.zoo")
