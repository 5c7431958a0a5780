"""Resuming a zoo build from its cached base checkpoint: the cache is read without unpickling code
(`torch.load(weights_only=True)`), so a planted file cannot run anything."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from droidmesh.shared.zoo.build import build_base
from droidmesh.shared.zoo.recipe import ops_hash
from droidmesh.shared.zoo.tiers import get_recipe
from droidmesh.shared.zoo.tokenizer import WordIds
from droidmesh.shared.zoo.train import Arch, new_model

ARCH = Arch(2, 32, 4, 2, 64)


class _Planted:
    """What a hostile cache file holds: unpickling it would create `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _cache_path(work, recipe):
    return work / f"base-{ops_hash(recipe, len(recipe.base_ops))}.pt"


def test_the_build_resumes_from_a_cached_base(tmp_path):
    """A cache of every base op, as the build saves it (arch, state, history): nothing left to run."""
    recipe, ids = get_recipe("ci"), WordIds()
    model = new_model(ARCH, ids, seed=3)
    torch.save({"arch": ARCH, "state": model.state_dict(), "history": {"base/x": {"final_loss": 1.5}}},
               _cache_path(tmp_path, recipe))
    history: dict = {}
    resumed = build_base(recipe, ids, tmp_path, history, lambda s: None)
    assert history == {"base/x": {"final_loss": 1.5}}
    # bitwise: loaded from the saved state dict: bytes
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), model.state_dict().values(), strict=True))


def test_a_planted_cache_file_runs_nothing(tmp_path):
    """A cache file whose pickle calls a function is refused before anything in it runs."""
    recipe, ids = get_recipe("ci"), WordIds()
    marker = tmp_path / "ran"
    torch.save({"arch": _Planted(str(marker)), "state": {}, "history": {}}, _cache_path(tmp_path, recipe))
    with pytest.raises(pickle.UnpicklingError):
        build_base(recipe, ids, tmp_path, {}, lambda s: None)
    assert not marker.exists()
