"""Model adapter: load a local HF causal LM and run it layer by layer.

`ModelAdapter` is the narrow interface the engine uses (called from the engine's worker thread;
every method blocks while torch computes):
  - `embed(ids)`                      token ids -> E_0
  - `run_layers(h, start, end, ...)`  E_start -> E_end, filling the cache's layers start..end-1
  - `run_sparse_layer(h, l, ...)`     one layer on scattered token positions (token-level recompute)
  - `logits(h)`                       final norm + LM head
  - `attn_input(h, l)` / `project_kv(x, l)`  layer l's normalized attention input, and the K/V its
                                      own projections (and RoPE) make of one (SCD's patch, `shared/kv/scd.py`)
A manual layer loop matches the model's own forward exactly when the causal pattern over a
non-empty cache is lower-right aligned (with transformers' sdpa, `attention_mask=None` there
silently aligns it top-left). The default attention (`shared/model/attention.py`) aligns it from
the lengths, with no mask and no K/V head expansion; `sdpa` and `eager` get an explicit mask.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from droidmesh.shared.errors import BadRequestError, CheckpointNotFoundError, UnsupportedModelError
from droidmesh.shared.model import attention, hf_cache
from droidmesh.shared.model.device import DEFAULT_DEVICE, resolve_device, resolve_dtype
from droidmesh.shared.model.fingerprint import ArchFingerprint, fingerprint_of

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTN_IMPLEMENTATIONS = (attention.NAME, "sdpa", "eager")
attention.register()


@dataclasses.dataclass
class ModelAdapter:
    """A decoder-only LM plus what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: Any | None
    name: str

    def __post_init__(self) -> None:
        cfg = self.model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {cfg.model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        impl = cfg._attn_implementation
        if impl not in ATTN_IMPLEMENTATIONS:
            raise UnsupportedModelError(f"attention implementation {impl!r}; use one of {ATTN_IMPLEMENTATIONS}")
        self.model.eval()
        self.fingerprint: ArchFingerprint = fingerprint_of(cfg, self.tokenizer)
        # Sliding-window layers keep only the last W tokens; within W they equal full attention,
        # which is the only regime the engine accepts (checked per call in `check_length`).
        self.window: int | None = getattr(cfg, "sliding_window", None) if _has_sliding(cfg) else None

    # -- facts -----------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int]:
        """Per-layer K (and V) shape for `tokens` context tokens, batch 1."""
        fp = self.fingerprint
        return (1, fp.num_kv_heads, tokens, fp.head_dim)

    def e_shape(self, tokens: int) -> tuple[int, int, int]:
        """E (hidden state entering a layer) shape for `tokens` context tokens, batch 1."""
        return (1, tokens, self.fingerprint.hidden_size)

    def check_length(self, tokens: int) -> None:
        if self.window is not None and tokens >= self.window:
            raise BadRequestError(f"{tokens} tokens exceed the sliding window {self.window} of {self.name}")

    def new_cache(self, capacity: int | None = None) -> Any:
        """An empty cache; `capacity`: the tokens it will hold (prompt + decoded), written once."""
        return hf_cache.new_cache(self.model.config, capacity)

    def token_tensor(self, ids: Sequence[int]) -> torch.Tensor:
        """Token ids -> [1, T] int64 on the model's device (where `embed` reads them)."""
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    # -- the three calls -------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, T] -> E_0 [1, T, D]."""
        return self.model.model.embed_tokens(ids.to(self.device))

    def run_layers(self, h: torch.Tensor, start: int, end: int, cache: Any, past: int) -> torch.Tensor:
        """Run decoder layers start..end-1 on h [1, T, D] sitting at positions past..past+T-1.

        Layer l attends to whatever `cache` layer l already holds (exactly `past` tokens) plus
        the new tokens, and appends the new tokens' K/V to it. Returns E_end [1, T, D].
        """
        t = h.shape[1]
        positions = torch.arange(past, past + t, device=h.device)[None]  # [1, T]
        cos, sin = self.model.model.rotary_emb(h, positions)  # each [1, T, head_dim]
        mask = self._mask(past, t, h.dtype, h.device)
        for layer in self.model.model.layers[start:end]:
            h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                      **hf_cache.layer_kwargs(layer, cache))
        return h

    def run_sparse_layer(
        self, h: torch.Tensor, layer: int, cache: Any, positions: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Run one layer on tokens at arbitrary `positions` [1, n] (h [1, n, D]) with an explicit
        boolean visibility `allowed` [1, 1, n, past+n] over (cache contents + these tokens).
        Used by token-level recompute, where the recomputed tokens are scattered."""
        cos, sin = self.model.model.rotary_emb(h, positions)  # each [1, n, head_dim]
        impl = self.config._attn_implementation
        mask = allowed if impl in ("sdpa", attention.NAME) else _additive(allowed, h.dtype)
        block = self.model.model.layers[layer]
        return block(h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                     **hf_cache.layer_kwargs(block, cache))

    def attn_input(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """E_layer [1, T, D] -> layer `layer`'s normalized attention input [1, T, D]."""
        return self.model.model.layers[layer].input_layernorm(h)

    def attn_norm(self, layer: int) -> tuple[torch.Tensor, float]:
        """(weight [D], epsilon) of layer `layer`'s input RMSNorm (what `attn_input` applies)."""
        norm = self.model.model.layers[layer].input_layernorm
        return norm.weight.detach(), float(norm.variance_epsilon)

    def project_kv(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A normalized attention input x [1, T, D] at positions 0..T-1 -> layer `layer`'s K, V
        [1, kv_heads, T, head_dim], by the same operations as the layer's own forward (K/V
        projections, Qwen3's per-head K norm, RoPE), so the true input gives the layer's own KV."""
        attn = self.model.model.layers[layer].self_attn
        t, hd = x.shape[1], self.fingerprint.head_dim
        k = attn.k_proj(x).view(1, t, -1, hd)  # [1, T, kvh, hd]
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)  # [1, kvh, T, hd]
        v = attn.v_proj(x).view(1, t, -1, hd).transpose(1, 2)  # [1, kvh, T, hd]
        positions = torch.arange(t, device=x.device)[None]  # [1, T]
        cos, sin = self.model.model.rotary_emb(x, positions)  # each [1, T, hd]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, hd]
        half = hd // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)  # rotate_half(k)
        return k * cos + rotated * sin, v

    def rope_tables(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim / 2] float32 on the CPU, attention scaling): the model's RoPE."""
        rot = self.model.model.rotary_emb
        return rot.inv_freq.detach().float().cpu(), float(rot.attention_scaling)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """E_L [1, T, D] -> logits [1, T, vocab] (final norm, LM head), in float32."""
        return self.model.lm_head(self.model.model.norm(h)).float()

    # -- helpers ---------------------------------------------------------------------------
    def _mask(self, past: int, t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        impl = self.config._attn_implementation
        if impl == attention.NAME and self.window is None:
            return None  # the kernel takes causality from the lengths (`shared/model/attention.py`)
        if past == 0 and impl in ("sdpa", attention.NAME):
            return None  # plain causal over an empty cache: sdpa's is_causal path is exact and fast
        return causal_mask(past, t, impl, dtype, device)


def causal_mask(past: int, t: int, impl: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Mask [1, 1, T, past+T] letting query i (position past+i) see keys 0..past+i.

    sdpa takes a boolean mask (True = attend); eager takes an additive float mask.
    """
    q = torch.arange(past, past + t, device=device)[:, None]  # [T, 1]
    k = torch.arange(past + t, device=device)[None, :]  # [1, past+T]
    allowed = (k <= q)[None, None]  # [1, 1, T, past+T]
    return allowed if impl in ("sdpa", attention.NAME) else _additive(allowed, dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility -> eager attention's additive mask (0 where visible, -inf-ish elsewhere)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _has_sliding(cfg: Any) -> bool:
    types = getattr(cfg, "layer_types", None) or []
    return "sliding_attention" in types


def load_model(
    path: str | os.PathLike,
    *,
    device: str = DEFAULT_DEVICE,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = attention.NAME,
    name: str | None = None,
) -> ModelAdapter:
    """Load a local HF checkpoint (config + weights [+ tokenizer]) onto `device`; never touches
    the hub. `dtype` None follows the device (see `shared.device`).

    A directory holding `adapter_config.json` is a PEFT adapter (LoRA and the other adapter types
    peft can merge into their base, e.g. DoRA, IA3, LoHa): its base is loaded and the adapter
    merged, so the result is an ordinary model with the adapter's weights. Prompt-learning
    adapters (prefix / prompt tuning) add virtual tokens and are refused.
    """
    dev = resolve_device(device)  # first: a missing GPU is a ConfigError before any file is read
    p = Path(path).expanduser()
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise CheckpointNotFoundError(f"no local checkpoint at {p} (expected config.json); DroidMesh never downloads")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise UnsupportedModelError(f"attention implementation {attn_implementation!r}; use {ATTN_IMPLEMENTATIONS}")
    kw = dict(dtype=resolve_dtype(dtype, dev), attn_implementation=attn_implementation, local_files_only=True)
    if (p / "adapter_config.json").is_file():
        model = _load_lora(p, kw)
    else:
        model_type = AutoConfig.from_pretrained(p, local_files_only=True).model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"{p}: model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
        model = AutoModelForCausalLM.from_pretrained(p, **kw)
    tok = _load_tokenizer(p)
    # Weights are read (and a LoRA merged) on the CPU, then moved once: the engine's tensors are
    # all born on `model.device` from here on.
    moved = model.to(dev)  # type: ignore[arg-type]  # transformers' stub wraps Module.to, mypy misreads it
    return ModelAdapter(model=moved, tokenizer=tok, name=name or p.name)


def _load_lora(p: Path, kw: dict[str, Any]) -> PreTrainedModel:
    from peft import PeftConfig, PeftModel  # imported lazily: only adapter checkpoints need it

    peft_cfg = PeftConfig.from_pretrained(str(p), local_files_only=True)
    kind = getattr(peft_cfg.peft_type, "value", peft_cfg.peft_type)  # PeftType is a str enum
    if peft_cfg.is_prompt_learning:
        raise UnsupportedModelError(
            f"adapter {p}: peft type {kind} adds virtual tokens and cannot be merged into its base; "
            "use an adapter peft merges (LoRA, DoRA, IA3, LoHa, LoKr, ...)")
    base_path = lora_base(p)
    assert base_path is not None  # adapter_config.json exists
    model_type = AutoConfig.from_pretrained(base_path, local_files_only=True).model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{p}: its base {base_path} has model_type {model_type!r}, not one of {SUPPORTED_MODEL_TYPES}")
    model = AutoModelForCausalLM.from_pretrained(base_path, **kw)
    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5; nothing for a user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = PeftModel.from_pretrained(model, p, local_files_only=True)
        if not hasattr(peft_model, "merge_and_unload"):
            raise UnsupportedModelError(f"adapter {p}: peft type {kind} cannot be merged into its base")
        return peft_model.merge_and_unload()


def _load_tokenizer(p: Path) -> Any | None:
    for candidate in (p, lora_base(p)):
        if candidate is not None and (candidate / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(candidate, local_files_only=True)
    return None


def lora_base(p: Path) -> Path | None:
    """The base checkpoint of the adapter in `p` (None: `p` is no adapter).

    `base_model_name_or_path` is what peft's `save_pretrained` wrote: a local directory,
    absolute or relative. A relative one is looked up relative to the adapter directory (the
    zoo writes `../base`), then relative to the working directory (what peft writes when the
    base was loaded by a relative path). Raises CheckpointNotFoundError (one line) when neither
    holds a checkpoint: DroidMesh never downloads a hub id."""
    cfg = p / "adapter_config.json"
    if not cfg.is_file():
        return None
    try:
        raw = json.loads(cfg.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointNotFoundError(f"adapter {p}: {cfg.name} is not a JSON object ({e})") from None
    if not raw or not isinstance(raw, str):
        raise CheckpointNotFoundError(f"adapter {p}: {cfg.name} names no base_model_name_or_path")
    base = Path(raw).expanduser()
    candidates = [base] if base.is_absolute() else [(p / base).resolve(), base.resolve()]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    looked = " or ".join(str(c) for c in dict.fromkeys(candidates))
    raise CheckpointNotFoundError(
        f"adapter {p}: its base {raw!r} is not a local checkpoint (looked in {looked}); DroidMesh never downloads: "
        f"set base_model_name_or_path in {cfg} to the base model's directory (absolute, or relative to the adapter)")


def random_model(
    model_type: str = "llama",
    *,
    seed: int = 0,
    device: str = DEFAULT_DEVICE,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = attention.NAME,
    name: str | None = None,
    **config: Any,
) -> ModelAdapter:
    """A random-init model of the given family (tests, benchmarks before the zoo exists).

    Initialised on the CPU from `seed`, then moved: one seed gives the same weights on every device.
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
    dev = resolve_device(device)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model = model.to(device=dev, dtype=resolve_dtype(dtype, dev))
    return ModelAdapter(model=model, tokenizer=None, name=name or f"random-{model_type}-{seed}")
