"""Architecture fingerprint: everything that must match for KV to be exchangeable.

Two models may share KV only if every field here is equal: the layer count and the per-layer
K/V layout (kv heads × head dim), the hidden size (E tensors), RoPE (keys are stored after
rotation, so positions must encode identically) and the tokenizer (token ids must mean the same
text). Weights are deliberately *not* part of it: differing weights are the whole point.

Models with sliding-window layers (Gemma 3's interleaved local and global layers, Mistral) add
to the `rope` field which layer is which and its window: a key means the same to a layer
reading it only under the same rotation base (Gemma 3's differs per layer type) and the same
view. Models without any keep the plain RoPE JSON, so their ids are unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from droidmesh.shared.errors import IncompatibleModelsError


@dataclasses.dataclass(frozen=True)
class ArchFingerprint:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: str  # canonical JSON of the RoPE parameters
    vocab_hash: str  # sha256 of the tokenizer's (token, id) table, or of the vocab size alone

    @property
    def id(self) -> str:
        """A short stable id (16 hex chars) of all fields; equal ids ⇔ equal fingerprints."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def diff(self, other: ArchFingerprint) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ, as {field: (self's, other's)}."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchFingerprint:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def require_compatible(sender: ArchFingerprint, receiver: ArchFingerprint) -> None:
    """Raise `IncompatibleModelsError` naming each differing field, unless the two match."""
    diff = sender.diff(receiver)
    if diff:
        raise IncompatibleModelsError(diff)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window W (the query at position p sees keys p-W+1..p), or
    None for full attention; as transformers' models decide it: by `layer_types` where the config
    has them (Gemma 3, Qwen2/3), else one `sliding_window` for every layer (Mistral)."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * n
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _rope_params(config: Any) -> str:
    # transformers 5 keeps RoPE settings in `rope_parameters` (type, theta, scaling...); Gemma 3
    # keys them by layer type.
    params = getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", None),
        "rope_scaling": getattr(config, "rope_scaling", None),
    }
    windows = layer_windows(config)
    if any(w is not None for w in windows):
        params = {"rope": params, "layer_types": getattr(config, "layer_types", None), "windows": windows}
    return json.dumps(params, sort_keys=True, default=str)


def vocab_hash(tokenizer: Any | None, vocab_size: int) -> str:
    """Hash of the token table; without a tokenizer (random-init tests) only the size counts."""
    if tokenizer is None:
        payload = f"vocab_size={vocab_size}".encode()
    else:
        table = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        payload = json.dumps(table, ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def fingerprint_of(config: Any, tokenizer: Any | None = None) -> ArchFingerprint:
    """The fingerprint of a transformers config (+ tokenizer, when the model has one)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ArchFingerprint(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        rope=_rope_params(config),
        vocab_hash=vocab_hash(tokenizer, config.vocab_size),
    )
