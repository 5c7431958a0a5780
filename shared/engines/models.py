"""The receiver's own weights inside an engine's worker: loaded on first use, the LoRA adapters of
one base as views over one copy of it, and used by one call sequence at a time.

An engine serving a base and N fine-tunes of it (vLLM: its LoRA adapters) recomputes plans and
computes held contexts' E with DroidMesh's own copy of those models. Loaded one by one
(`load_model` merges an adapter into its base) that copy would be N + 1 full models; here the
models of `EngineSettings.models` that are adapters of one base are loaded together, once, as an
`AdapterSet`: one copy of the base, each adapter unmerged beside it (a few MB each), the base's
own ids served by the set's base view. A model that is no adapter and has none among the models
loads alone.

The views of one set share their modules and switch the active adapter per call, so two threads
must not interleave two views' calls: every computation runs inside `using(model_id)`, one lock
for all the models (the worker's loads and the holder's E take turns). Properties that compute
nothing (`num_layers`, `kv_shape`, `dtype`) may be read outside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.adapter import ModelAdapter, load_model, lora_base
from droidmesh.shared.model.names import local_path

BASE_VIEW = "base-weights"  # the set's own name for a base no model id names


def family(models: Mapping[str, str], model_id: str) -> tuple[Path, dict[str, Path], list[str]]:
    """For `model_id`: (the base checkpoint its weights build on, the ids among `models` that are
    adapters of that base -> their directories, the ids whose checkpoint is that base itself)."""
    if model_id not in models:
        raise ConfigError(f"no model {model_id!r}; the engine's models are {', '.join(sorted(models))}")
    paths = {m: local_path(p) for m, p in models.items()}
    under = {m: lora_base(p) for m, p in paths.items()}  # an adapter's base checkpoint; None: no adapter
    roots = {m: (under[m] or paths[m]).resolve() for m in paths}
    kin = [m for m in paths if roots[m] == roots[model_id]]
    return roots[model_id], {m: paths[m] for m in kin if under[m] is not None}, [m for m in kin if under[m] is None]


class EngineModels:
    """`EngineSettings.models`, loaded on first use in `dtype` on `device`."""

    def __init__(self, models: Mapping[str, str], device: str, dtype: str):
        self._paths, self._device, self._dtype = dict(models), device, dtype
        self._loaded: dict[str, ModelAdapter] = {}
        self._lock = threading.RLock()

    @classmethod
    def of(cls, loaded: Mapping[str, ModelAdapter]) -> EngineModels:
        """Models already loaded (the in-process version, for tests), served as they are."""
        models = cls(dict.fromkeys(loaded, ""), "cpu", "float32")
        models._loaded.update(loaded)
        return models

    def get(self, model_id: str) -> ModelAdapter:
        """The model (loading it and its family first if needed), for what computes nothing."""
        with self._lock:
            if model_id not in self._loaded:
                self._loaded.update(self._load(model_id))
            return self._loaded[model_id]

    def preload(self) -> None:
        """Load every model now (each family once), so no request waits for a load."""
        for model_id in self._paths:
            self.get(model_id)

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[ModelAdapter]:
        """The model, with no other model's computation running until the block ends."""
        with self._lock:
            yield self.get(model_id)

    def _load(self, model_id: str) -> dict[str, ModelAdapter]:
        base, adapters, bases = family(self._paths, model_id)
        if not adapters:
            return {model_id: load_model(self._paths[model_id], device=self._device, dtype=self._dtype, name=model_id)}
        from droidmesh.shared.model.lora import AdapterSet  # peft only where adapters are served

        base_name = bases[0] if bases else BASE_VIEW
        views = AdapterSet.load(base, adapters, device=self._device, dtype=self._dtype, base_name=base_name).views()
        return {**{m: views[m] for m in adapters}, **dict.fromkeys(bases, views[base_name])}
