"""The receiver's own weights in an engine's worker (`engines/models.py`): the LoRA adapters of one
base are views over one copy of it, each its own model; another checkpoint loads alone; one
computation runs at a time.

On the tiny random Llama and two random LoRAs of `tests/unit/model/test_adapters.py`. The old
bridge loaded each model with `load_model` (three full copies for the base and its two adapters);
these tests fail there at the import (no `engines.models`)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from droidmesh.shared.engines.models import EngineModels, family
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from tests.conftest import ATOL
from tests.unit.model.test_adapters import dirs  # noqa: F401 - the module's fixture: base, a, b

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
IDS = [1, 5, 9, 13, 17, 21, 25, 29]


@pytest.fixture(scope="module")
def models(dirs, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    other = tmp_path_factory.mktemp("other") / "other"
    shutil.copytree(dirs["base"], other)  # a checkpoint of its own: no adapter of it is served
    return {"main": str(dirs["base"]), "qa": str(dirs["a"]), "code": str(dirs["b"]), "other": str(other)}


def _logits(model: ModelAdapter) -> torch.Tensor:
    with torch.inference_mode():
        h = model.run_layers(model.embed(model.token_tensor(IDS)), 0, model.num_layers, model.new_cache(), past=0)
        return model.logits(h)


def test_the_family_of_a_model_is_its_base_and_the_adapters_of_it(models, dirs):  # noqa: F811
    base, adapters, bases = family(models, "qa")
    assert base == dirs["base"].resolve() and set(adapters) == {"qa", "code"} and bases == ["main"]
    assert family(models, "main")[1].keys() == {"qa", "code"}
    assert family(models, "other") == (Path(models["other"]).resolve(), {}, ["other"])
    with pytest.raises(ConfigError, match="no model 'nope'"):
        family(models, "nope")


def test_the_adapters_of_one_base_share_one_copy_of_it_and_each_runs_as_its_own(models, dirs):  # noqa: F811
    engine = EngineModels(models, "cpu", "float32")
    qa, code, main, other = (engine.get(m) for m in ("qa", "code", "main", "other"))
    assert qa.model is code.model is main.model and other.model is not main.model
    base_params = sum(p.numel() for p in load_model(dirs["base"], dtype="float32").model.parameters())
    assert sum(p.numel() for p in qa.model.parameters()) < 1.1 * base_params  # one base, adapters beside it
    for view, own in ((qa, dirs["a"]), (code, dirs["b"]), (main, dirs["base"])):
        with engine.using(view.name) as model:
            got = _logits(model)
        torch.testing.assert_close(got, _logits(load_model(own, dtype="float32")), atol=ATOL, rtol=0)


def test_one_computation_runs_at_a_time_over_the_shared_weights(models):
    """While one thread computes with view qa, another asking for view code waits (it would switch
    the shared modules' adapter under the first); both then get their own model's results."""
    engine = EngineModels(models, "cpu", "float32")
    alone = {m: _logits(engine.get(m)) for m in ("qa", "code")}
    inside, entered, release = threading.Event(), threading.Event(), threading.Event()
    got: dict[str, torch.Tensor] = {}

    def first() -> None:
        with engine.using("qa") as model:
            inside.set()
            release.wait(30)
            got["qa"] = _logits(model)

    def second() -> None:
        with engine.using("code") as model:
            entered.set()
            got["code"] = _logits(model)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert inside.wait(30)
    threads[1].start()
    assert not entered.wait(0.3)  # held off while qa's computation runs (with no lock it enters at once)
    release.set()
    for t in threads:
        t.join(30)
    assert entered.is_set()
    for m in ("qa", "code"):
        torch.testing.assert_close(got[m], alone[m], atol=ATOL, rtol=0)


def test_preload_loads_every_model_once_before_any_is_asked_for(models):
    """After `preload` every model is loaded (a base and its adapters as one set): asking for one
    loads nothing more."""
    engine = EngineModels(models, "cpu", "float32")
    engine.preload()
    loaded = dict(engine._loaded)
    assert set(loaded) == set(models)
    assert loaded["qa"].model is loaded["main"].model and loaded["other"].model is not loaded["main"].model
    assert all(engine.get(m) is loaded[m] for m in models)
