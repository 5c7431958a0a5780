"""Several PEFT adapters served from one copy of their base model's weights.

`load_model` merges an adapter into its base: one full copy of the weights per fine-tune, so a
process serving a base and three LoRAs of it holds four copies. `AdapterSet` loads the base once
and every adapter into it unmerged (peft injects its layers beside the base's Linear modules; a
LoRA of rank r adds r * (in + out) values per targeted projection, a few MB). Each served name
gets its own `ModelAdapter` view, the base's included, all over the same torch modules; a view's
`select` hook makes its adapter the active one (the base view: every adapter layer disabled)
before any engine call runs on it, so the engine, which only calls `ModelAdapter` methods, runs
each view as the model that view's directory would load alone.

What stays the same per view as a separate `load_model` of its directory: outputs (up to the
rounding of merged vs unmerged weights), the architecture fingerprint (the tokenizer is the
base's, checked equal to any an adapter ships), and the weights identity `sha256(name)`, so a
pair config profiled on a merged adapter applies to its view. A KV cache captured under one view
is that view's and can be reused by another (`shared/kv`), as between two processes.

Refused, one line each: adapters of another base, prompt-learning adapters (virtual tokens),
adapters whose kinds peft cannot hold side by side (different peft types), adapters that write
into the shared base when loaded (trained biases, PiSSA-style inits, KaSA, layer replication),
a served name used twice or equal to the base's, an adapter tokenizer with another vocabulary.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from droidmesh.shared.errors import CheckpointNotFoundError, ConfigError, UnsupportedModelError
from droidmesh.shared.model import attention
from droidmesh.shared.model.adapter import ATTN_IMPLEMENTATIONS, SUPPORTED_MODEL_TYPES, ModelAdapter, lora_base
from droidmesh.shared.model.device import DEFAULT_DEVICE, resolve_device, resolve_dtype
from droidmesh.shared.model.fingerprint import vocab_hash
from droidmesh.shared.model.names import local_path, weights_sha256

if TYPE_CHECKING:
    import torch

# LoRA inits that only set the adapter's own matrices (then overwritten by the saved ones); the
# others (pissa, olora, corda, loftq, ...) rewrite the base weight as the adapter is injected.
_BASE_PRESERVING_INITS = (True, False, "gaussian", "eva", "orthogonal")

PathLike = str | os.PathLike


class AdapterSet:
    """One base model's modules with several unmerged adapters; one `ModelAdapter` view each."""

    def __init__(self, peft_model: Any, base_path: Path, base_name: str, adapters: dict[str, Path],
                 tokenizer: Any | None):
        self.peft_model = peft_model
        self.base_path = base_path
        self.base_name = base_name
        self.paths: dict[str, Path] = {base_name: base_path, **adapters}
        # peft's own adapter names are internal: served names may hold '.' or '/', which a
        # ModuleDict key cannot.
        self._peft_names = {name: f"view{i}" for i, name in enumerate(adapters)}
        # The view whose adapter is active now (None: not known yet). Every engine call runs on
        # the one torch worker thread, so a plain attribute is enough: no two views' calls overlap.
        self._active: str | None = None
        hf_model = peft_model.base_model.model  # the HF causal LM, peft's layers injected into it
        self._views = {name: ModelAdapter(model=hf_model, tokenizer=tokenizer, name=name,
                                          select=_Selector(self, name))
                       for name in self.paths}

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        base_path: PathLike,
        adapters: Mapping[str, PathLike] | Iterable[tuple[str, PathLike]],
        *,
        device: str = DEFAULT_DEVICE,
        dtype: str | torch.dtype | None = None,
        base_name: str | None = None,
        attn_implementation: str = attention.NAME,
    ) -> AdapterSet:
        """Load the base checkpoint at `base_path` once and every adapter (served name -> its
        directory) unmerged into it; `base_name` (default: the base directory's name) serves the
        base itself. Local files only; `dtype` None follows the device, as `load_model`."""
        dev = resolve_device(device)  # first: a missing GPU is a ConfigError before any file is read
        base = local_path(base_path)
        if (base / "adapter_config.json").is_file():
            raise ConfigError(f"{base} is a PEFT adapter, not a base checkpoint; give the base it was trained on")
        if not (base / "config.json").is_file():
            raise CheckpointNotFoundError(f"no local checkpoint at {base} (expected config.json); DroidMesh never downloads")
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise UnsupportedModelError(f"attention implementation {attn_implementation!r}; use {ATTN_IMPLEMENTATIONS}")
        base_cfg = AutoConfig.from_pretrained(base, local_files_only=True)
        if (model_type := base_cfg.model_type) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"{base}: model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
        name0 = base_name or base.resolve().name
        tokenizer = _tokenizer(base)
        named = _check_names(name0, adapters)
        configs = {name: _check_adapter(name, p, base, tokenizer, base_cfg.vocab_size) for name, p in named.items()}
        kinds = {str(getattr(c.peft_type, "value", c.peft_type)) for c in configs.values()}
        if len(kinds) > 1:
            raise UnsupportedModelError(
                f"adapters of kinds {sorted(kinds)}: peft holds one kind of adapter per model; "
                "serve each kind from its own set")

        model = AutoModelForCausalLM.from_pretrained(base, dtype=resolve_dtype(dtype, dev),
                                                     attn_implementation=attn_implementation, local_files_only=True)
        peft_model = _inject(model, named)
        # Weights are read and adapters injected on the CPU, then moved once (as `load_model`).
        peft_model.to(dev)
        return cls(peft_model, base, name0, named, tokenizer)

    # -- views -----------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Served names: the base's first, then the adapters' in the order given."""
        return tuple(self.paths)

    def views(self) -> dict[str, ModelAdapter]:
        """Served name -> its view (all over the same modules; each selects its adapter per call)."""
        return dict(self._views)

    def view(self, name: str) -> ModelAdapter:
        return self._views[self._known(name)]

    def sha256(self, name: str) -> str:
        """The weights identity of view `name`: what a process loading its directory alone
        reports (the adapter's weight files for an adapter, the base's for the base)."""
        return weights_sha256(self.paths[self._known(name)])

    def added_params(self, name: str) -> int:
        """How many parameters view `name`'s adapter adds to the shared model (the base's: 0)."""
        if self._known(name) == self.base_name:
            return 0
        key = f".{self._peft_names[name]}."  # e.g. ...q_proj.lora_A.view0.weight
        return sum(p.numel() for n, p in self.peft_model.named_parameters() if key in n)

    @property
    def active(self) -> str | None:
        """The view whose adapter is active now (None: none selected yet)."""
        return self._active

    def activate(self, name: str) -> None:
        """Make view `name`'s adapter the one every injected layer applies (the base: none).
        Free when it already is; otherwise one walk over the model's modules."""
        if name == self._active:
            return
        tuner = self.peft_model.base_model
        if name == self.base_name:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            self.peft_model.set_adapter(self._peft_names[name], inference_mode=True)
        self._active = name

    def _known(self, name: str) -> str:
        if name not in self.paths:
            raise ConfigError(f"no view named {name!r}; this set serves {', '.join(self.paths)}")
        return name


class _Selector:
    """A view's `select` hook: activates its adapter in the set (a class, not a lambda, so a
    view's repr and a traceback name it)."""

    def __init__(self, owner: AdapterSet, name: str):
        self.owner, self.name = owner, name

    def __call__(self) -> None:
        self.owner.activate(self.name)

    def __repr__(self) -> str:
        return f"select({self.name!r})"


def _check_names(base_name: str, adapters: Mapping[str, PathLike] | Iterable[tuple[str, PathLike]]) -> dict[str, Path]:
    """(served name, directory) pairs -> a dict, refusing empty, repeated and base-clashing names."""
    pairs = list(adapters.items()) if isinstance(adapters, Mapping) else [tuple(a) for a in adapters]
    if not pairs:
        raise ConfigError("no adapters given; a base alone loads with load_model")
    out: dict[str, Path] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"adapter {path}: its served name {name!r} is empty")
        if name == base_name:
            raise ConfigError(f"adapter {path}: served name {name!r} is the base's; name it otherwise")
        if name in out:
            raise ConfigError(f"served name {name!r} given twice ({out[name]} and {path})")
        out[name] = local_path(path)
    return out


def _check_adapter(name: str, p: Path, base: Path, base_tokenizer: Any | None, vocab_size: int) -> Any:
    """Adapter directory `p` -> its PeftConfig, if it can share `base`'s modules with others."""
    from peft import PeftConfig  # imported lazily: only adapter sets need it

    if not (p / "adapter_config.json").is_file():
        raise CheckpointNotFoundError(f"adapter {name!r}: {p} holds no adapter_config.json (not a PEFT adapter)")
    own_base = lora_base(p)
    assert own_base is not None  # adapter_config.json exists
    if own_base.resolve() != base.resolve():
        raise ConfigError(f"adapter {name!r} ({p}) was trained on {own_base.resolve()}, not on {base.resolve()}")
    cfg = PeftConfig.from_pretrained(str(p), local_files_only=True)
    kind = getattr(cfg.peft_type, "value", cfg.peft_type)  # PeftType is a str enum
    if cfg.is_prompt_learning or getattr(cfg, "is_adaption_prompt", False):
        raise UnsupportedModelError(f"adapter {name!r} ({p}): peft type {kind} adds virtual tokens; "
                                    "use an adapter peft injects into layers (LoRA, DoRA, IA3, LoHa, LoKr, ...)")
    # read by name: a field of one adapter type's config, absent from others (and from PeftConfig's type)
    bias, init = getattr(cfg, "bias", "none"), getattr(cfg, "init_lora_weights", True)
    writes_base = [
        f"bias={bias!r} (trained base biases)" if bias != "none" else "",
        f"init_lora_weights={init!r}" if init not in _BASE_PRESERVING_INITS else "",
        "kasa_config" if getattr(cfg, "kasa_config", None) is not None else "",
        "layer_replication" if getattr(cfg, "layer_replication", None) else "",
    ]
    if any(writes_base):
        raise UnsupportedModelError(
            f"adapter {name!r} ({p}): {', '.join(w for w in writes_base if w)} changes the base's own weights or "
            "layers, which the other views share; load it alone (load_model merges it)")
    if getattr(cfg, "alora_invocation_tokens", None):
        raise UnsupportedModelError(f"adapter {name!r} ({p}): activated LoRA needs per-request invocation offsets "
                                    "the engine does not pass")
    if (p / "tokenizer_config.json").is_file():
        own = AutoTokenizer.from_pretrained(p, local_files_only=True)
        if base_tokenizer is None or vocab_hash(own, vocab_size) != vocab_hash(base_tokenizer, vocab_size):
            raise ConfigError(f"adapter {name!r} ({p}) ships a tokenizer whose vocabulary differs from the base's; "
                              "views share the base's embedding and tokenizer")
    return cfg


def _inject(model: Any, adapters: dict[str, Path]) -> Any:
    """Load every adapter unmerged into `model` (the first makes the PeftModel, the rest are
    added to it), under internal names view0, view1, ... in order."""
    from peft import PeftModel

    items = list(adapters.items())
    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5; nothing for a user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        first_name, first = items[0]
        peft_model = PeftModel.from_pretrained(model, first, adapter_name="view0", local_files_only=True)
        for i, (name, p) in enumerate(items[1:], start=1):
            try:
                peft_model.load_adapter(p, adapter_name=f"view{i}", local_files_only=True)
            except ValueError as e:  # peft's refusal to hold the two side by side
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise UnsupportedModelError(f"adapter {name!r} ({p}) cannot sit beside {first_name!r} in one "
                                            f"model: {msg}") from None
    return peft_model.eval()


def _tokenizer(base: Path) -> Any | None:
    if (base / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(base, local_files_only=True)
    return None
