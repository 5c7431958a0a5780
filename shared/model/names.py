"""Naming models and pairs: the one resolver of a model argument, and the one pair id.

Every command takes a model as a local checkpoint directory (`config.json`, or a PEFT adapter's
`adapter_config.json`) or as a built zoo model's name, as `droidmesh zoo list` prints it
(`demo/base`; a bare `base` is the first tier holding it, in `zoo list`'s order). A pair of
models is named `"{sender}-to-{receiver}"` everywhere: file names, command output, logs and the
config bucket's key (`shared.wire.subjects.config_key`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

from droidmesh.shared.errors import CheckpointNotFoundError

WEIGHT_SUFFIXES = (".safetensors", ".bin")
RANDOM_INIT = "random_init.json"  # a named shape's checkpoint without weights: {"seed": N} (`zoo/shapes.py`)


def local_path(arg: str | os.PathLike) -> Path:
    """A model argument as a local path, `~` expanded; a `~user` this host has no user for stays
    as written (pathlib raises for it, and a peer's request may carry one): then it is simply no
    checkpoint, and the caller's lookup says so."""
    try:
        return Path(arg).expanduser()
    except RuntimeError:
        return Path(arg)


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A resolved model: where its checkpoint is, the id it serves under, its tier (zoo models)."""

    path: Path
    name: str          # the model id: the zoo's model name, else the checkpoint directory's name
    tier: str | None = None
    manifest_sha256: str | None = None  # the zoo manifest's hash of the weights file

    @property
    def sha256(self) -> str:
        """Content hash of the weights: the manifest's, else computed (once per process) over
        the checkpoint's weight files. One weight file hashes as that file alone, as the zoo's
        manifest does."""
        return self.manifest_sha256 or weights_sha256(self.path)

    @property
    def label(self) -> str:
        """How `zoo list` names it (`demo/base`), else the checkpoint path."""
        return f"{self.tier}/{self.name}" if self.tier else str(self.path)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A sender -> receiver pair (by model id), optionally for a task."""

    sender: str
    receiver: str
    task: str = ""

    @property
    def id(self) -> str:
        return f"{self.sender}-to-{self.receiver}"

    def versioned(self, version: int) -> str:
        """The display name of a published config of this pair."""
        return f"{self.id} v{version}"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


@functools.lru_cache(maxsize=16)
def weights_sha256(path: Path) -> str:
    """sha256 over a checkpoint's weight files, in name order (one file: that file's sha256)."""
    files = sorted(f for f in Path(path).iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    if not files and (Path(path) / RANDOM_INIT).is_file():  # a named shape's weights: its config and seed
        files = [Path(path) / "config.json", Path(path) / RANDOM_INIT]
    if not files:
        raise CheckpointNotFoundError(f"no weight files (*.safetensors, *.bin) in {path}")
    return sha256_files(files)


def sha256_file(path: Path) -> str:
    return sha256_files([path])


def sha256_files(files: list[Path]) -> str:
    """One sha256 over the files' bytes, in the given order."""
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
