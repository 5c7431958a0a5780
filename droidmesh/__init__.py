"""DroidMesh: reuse one LLM's KV cache in another, recomputing only a critical layer group.

The repository keeps `shared/` (the library) and `services/` (one folder per process) at its top;
they are installed as `droidmesh.shared` and `droidmesh.services` (in a checkout, `droidmesh/`
links to them), so nothing generic lands at the top of site-packages. The package also carries
the NATS configuration files (`nats_config/`) and the demo tier of the zoo (`zoo/demo`).
"""

from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
NATS_CONFIG_DIR = PACKAGE_DIR / "nats_config"
ZOO_DIR = PACKAGE_DIR / "zoo"
