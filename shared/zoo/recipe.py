"""Zoo recipes: every number that determines a tier's weights, hashed into its manifest.

A recipe is data (frozen dataclasses): the base's training ops, the derivatives fine-tuned
from it, and the pairs the zoo intends. `recipe_hash` covers the recipe plus RECIPE_VERSION
(bump it when training code changes what a recipe produces), so a cached tier is rebuilt
exactly when its recipe changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from droidmesh.shared.model.names import Pair
from droidmesh.shared.tasks.suite import SuiteShape
from droidmesh.shared.zoo.train import Arch, Stage

# RECIPE_VERSION covers everything; BASE_VERSION only the code paths the base ops run (its
# intermediate states are cached by it). Bump the one whose code changed what it produces.
RECIPE_VERSION = "zoo-v3"
BASE_VERSION = "zoo-v1"


@dataclasses.dataclass(frozen=True)
class Op:
    """One base-building op: new(arch) | train(stage) | reinit_above(n) | grow(placement)."""

    kind: str
    arch: Arch | None = None
    stage: Stage | None = None
    n: int = 0
    placement: tuple[int | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class Derivative:
    """A model fine-tuned from the base. kind: full | lora. `task` is what it is fine-tuned for.
    In `stage.train`, `reader-1` / `reader` resolve to layers relative to the base's measured
    retrieval (reader) layer -- see `build.find_reader`."""

    name: str
    kind: str
    task: str
    stages: tuple[Stage, ...]
    init_aliases: bool = False  # start alias embeddings as copies of their keys' (train.init_aliases)
    lora_r: int = 8


@dataclasses.dataclass(frozen=True)
class Recipe:
    tier: str
    seed: int
    base_ops: tuple[Op, ...]
    derivatives: tuple[Derivative, ...]
    pairs: tuple[Pair, ...]
    suite: SuiteShape
    threads: int = 1          # fixed thread count: same recipe, same machine -> same bits
    save_dtype: str = "bfloat16"
    eval_rows: int = 48       # test rows per task the tier's report uses


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    return {"version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe)}


def recipe_hash(recipe: Recipe) -> str:
    blob = json.dumps(recipe_dict(recipe), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def ops_hash(recipe: Recipe, upto: int) -> str:
    """Hash of the base ops [0, upto): the key of a cached intermediate base state."""
    blob = json.dumps(
        {"version": BASE_VERSION, "seed": recipe.seed, "ops": [dataclasses.asdict(o) for o in recipe.base_ops[:upto]]},
        sort_keys=True, default=str,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
