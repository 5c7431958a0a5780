"""Resolve a model argument: a local checkpoint path, or the name of a built zoo model."""

from __future__ import annotations

import json
from pathlib import Path

import click

REPO_ZOO = Path(__file__).resolve().parents[2] / "zoo"


def zoo_roots() -> list[Path]:
    """Where built tiers may live: the committed demo tier first, then the cache dirs."""
    from shared.zoo.build import zoo_dir

    return [REPO_ZOO / "demo", zoo_dir("demo"), zoo_dir("ci")]


def resolve(arg: str) -> tuple[str, str]:
    """(checkpoint path, model id) for a path or a zoo model name."""
    p = Path(arg).expanduser()
    if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
        return str(p), p.name
    for root in zoo_roots():
        man = root / "manifest.json"
        if man.is_file():
            models = json.loads(man.read_text())["models"]
            if arg in models:
                return str(root / models[arg]["path"]), arg
    raise click.BadParameter(f"{arg!r} is neither a local checkpoint nor a model of a built zoo tier "
                             f"(looked in {', '.join(map(str, zoo_roots()))}); run `droidmesh zoo build`")
