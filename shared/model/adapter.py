"""Model adapter: load a local HF causal LM and run it layer by layer.

`ModelAdapter` is the narrow interface the engine uses (called from the engine's worker thread;
every method blocks while torch computes):
  - `embed(ids)`                      token ids -> E_0
  - `run_layers(h, start, end, ...)`  E_start -> E_end, filling the cache's layers start..end-1
  - `run_sparse_layer(h, l, ...)`     one layer on scattered token positions (token-level recompute)
  - `decode(tokens, caches, pasts)`   one decode step of several requests, each over its own cache
  - `decode_slots(ids, positions, s)` one decode step over a decode pool's slots (replayable)
  - `logits(h)`                       final norm + LM head
  - `attn_input(h, l)` / `project_kv(x, l)`  layer l's normalized attention input, and the K/V its
                                      own projections (and RoPE) make of one (SCD's patch, `shared/kv/scd.py`)
The engine's own attention (`shared/model/attention.py`) needs no mask; `sdpa` and `eager` get
the explicit one `masks.py` builds. `attn_input`, `attn_norm`, `project_kv` and `rope_tables`
come from `projections.py`'s `LayerProjections`.

Families: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (`gemma3_text`, transformers'
`Gemma3ForCausalLM`). What Gemma 3 does differently lives in its own modules (q/k norms, the
(1 + w) RMSNorm, `query_pre_attn_scalar`, the embedding scaled by sqrt(hidden), tied
embeddings); the adapter supplies what a layer is handed from outside: the RoPE of its layer
type (local and global layers rotate by different bases) and, for its sliding-window layers,
the window's visibility. Sliding-window layers: the engine's cache keeps the K/V of *every*
position for them, as for full layers (`hf_cache.new_cache`), and the attention masks each query
to its window (`windows[l]`); so a captured context is every layer's K/V of every context token,
[1, kv_heads, T, head_dim], sliding layers included: a sender can serve any prefix of it. A pull
moves less: a reused sliding layer's K/V only from the first token the suffix's window reaches
(`ReusePlan.window_starts`, the last W-1 context tokens), zeros before it in the receiver's cache,
never read.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from droidmesh.shared.errors import CheckpointNotFoundError, UnsupportedModelError
from droidmesh.shared.model import attention, hf_cache
from droidmesh.shared.model.device import DEFAULT_DEVICE, resolve_device, resolve_dtype
from droidmesh.shared.model.fingerprint import ArchFingerprint, fingerprint_of, layer_windows
from droidmesh.shared.model.masks import additive, layer_mask
from droidmesh.shared.model.names import RANDOM_INIT, local_path
from droidmesh.shared.model.projections import LayerProjections

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ATTN_IMPLEMENTATIONS = (attention.NAME, "sdpa", "eager")
attention.register()


@dataclasses.dataclass
class ModelAdapter(LayerProjections):
    """A decoder-only LM plus what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    # Called first by every engine-facing call: makes this view's adapter the active one where
    # several views share one model's modules (`shared/model/lora.py`). None: the model is
    # this adapter's alone, nothing to select. A direct `model(...)` call bypasses it.
    select: Callable[[], None] | None = dataclasses.field(default=None, repr=False, compare=False)
    # Short passes (batch 1, few tokens) replayed from captured layer pieces (`graphs.LayerGraphs`,
    # CUDA graphs on a GPU); None: every pass eager. Set by whoever hosts the model, then warmed.
    graphs: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        cfg = self.model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {cfg.model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        impl = cfg._attn_implementation
        if impl not in ATTN_IMPLEMENTATIONS:
            raise UnsupportedModelError(f"attention implementation {impl!r}; use one of {ATTN_IMPLEMENTATIONS}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{cfg.model_type} with bidirectional attention is an encoder, not a causal LM")
        self.model.eval()
        self.fingerprint: ArchFingerprint = fingerprint_of(cfg, self.tokenizer)
        # Per layer: its sliding window (None: full attention), and the key of its RoPE table
        # (Gemma 3's rotary module takes the layer type; None: one table for every layer).
        self.windows: tuple[int | None, ...] = layer_windows(cfg)
        # What a pull leaves out of a sliding layer (`ReusePlan.window_starts`) is decided by
        # these windows: each must be the one the layer's attention module itself applies.
        for l, layer in enumerate(self.model.model.layers):
            own = getattr(layer.self_attn, "sliding_window", self.windows[l])
            if (own or None) != self.windows[l]:
                raise UnsupportedModelError(f"layer {l} attends over a window of {own}, its config says {self.windows[l]}")
        per_type = "layer_type" in inspect.signature(type(self.model.model.rotary_emb).forward).parameters
        self.rope_kinds: tuple[str | None, ...] = tuple(cfg.layer_types) if per_type else (None,) * cfg.num_hidden_layers

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
        """Every length is served: sliding-window layers keep every token and are masked to their
        window (nothing is dropped that a longer prompt would need). Kept as the one place a
        per-model length limit would go."""

    def new_cache(self, capacity: int | None = None) -> Any:
        """An empty cache; `capacity`: the tokens it will hold (prompt + decoded), written once."""
        if self.select is not None:
            self.select()
        return hf_cache.new_cache(self.model.config, capacity)

    def token_tensor(self, ids: Sequence[int]) -> torch.Tensor:
        """Token ids -> [1, T] int64 on the model's device (where `embed` reads them)."""
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    # -- the three calls -------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, T] -> E_0 [1, T, D]."""
        if self.select is not None:
            self.select()
        return self.model.model.embed_tokens(ids.to(self.device))

    def run_layers(self, h: torch.Tensor, start: int, end: int, cache: Any, past: int) -> torch.Tensor:
        """Run decoder layers start..end-1 on h [1, T, D] sitting at positions past..past+T-1.

        Layer l attends to whatever `cache` layer l already holds (exactly `past` tokens) plus
        the new tokens, and appends the new tokens' K/V to it. Returns E_end [1, T, D].
        """
        if self.select is not None:
            self.select()
        if self.graphs is not None and self.graphs.covers(h):
            return self.graphs.run(h, start, end, cache, past)
        t = h.shape[1]
        positions = torch.arange(past, past + t, device=h.device)[None]  # [1, T]
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE kind, computed once
        masks: dict[int | None, torch.Tensor | None] = {}  # per window, built once
        for l in range(start, end):
            layer = self.model.model.layers[l]
            if (kind := self.rope_kinds[l]) not in tables:
                tables[kind] = self._rope(h, positions, l)  # each [1, T, head_dim]
            if (window := self.windows[l]) not in masks:
                masks[window] = layer_mask(self.config._attn_implementation, past, t, window, h.dtype, h.device)
            h = layer(h, attention_mask=masks[window], position_ids=positions, position_embeddings=tables[kind],
                      **hf_cache.layer_kwargs(layer, cache))
        return h

    @property
    def batches(self) -> bool:
        """Whether several requests' decode steps run as one forward (`decode`): through the
        engine's own attention only, which reads each row's cache on its own."""
        return self.config._attn_implementation == attention.NAME

    def decode(self, tokens: Sequence[int], caches: Sequence[Any], pasts: Sequence[int]) -> torch.Tensor:
        """One decode step of B requests together: row b feeds `tokens[b]` at position `pasts[b]`
        over its own cache `caches[b]` (holding exactly pasts[b] tokens), which gains that token's
        K/V in every layer. Returns E_L [B, 1, D]. The weights are read once for the batch; each
        row attends over its own cache (`hf_cache.RaggedCache`), so lengths may differ."""
        if self.select is not None:
            self.select()
        if not self.batches:
            raise UnsupportedModelError(f"batched decode needs the {attention.NAME} attention, not "
                                        f"{self.config._attn_implementation}")
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)  # [B, 1]
        positions = torch.tensor([[p] for p in pasts], dtype=torch.long, device=self.device)  # [B, 1]
        h = self.model.model.embed_tokens(ids)  # [B, 1, D]
        ragged = hf_cache.RaggedCache(list(caches))
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE kind
        for l in range(self.num_layers):
            layer = self.model.model.layers[l]
            if (kind := self.rope_kinds[l]) not in tables:
                tables[kind] = self._rope(h, positions, l)  # each [B, 1, head_dim]
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=tables[kind],
                      **hf_cache.layer_kwargs(layer, ragged))
        return h

    def decode_slots(self, ids: torch.Tensor, positions: torch.Tensor, slots: hf_cache.SlotsStep) -> torch.Tensor:
        """One decode step over a decode pool's first B slots (`shared/kv/pool.py`): row b feeds
        `ids[b]` at position `positions[b]` (both [B] on the model's device) over slot b, whose
        tokens 0..positions[b]-1 are its cache, and writes that token's K/V at positions[b].
        Returns logits [B, vocab] (float32). Sizes follow from B and `slots.keys` alone and no
        value is read back to the host, so a CUDA graph can capture it. A position of `keys` or
        more (a scratch write, never a real row's) is masked as if it were keys - 1."""
        if self.select is not None:
            self.select()
        h = self.model.model.embed_tokens(ids[:, None])  # [B] -> [B, 1, D]
        pos = positions[:, None]  # [B, 1]
        last = positions.clamp(max=slots.keys - 1)[:, None]  # [B, 1]: the last key each row's query sees
        k = torch.arange(slots.keys, device=ids.device)[None]  # [1, keys]
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE kind
        masks: dict[int | None, torch.Tensor] = {}  # per window: [B, 1, 1, keys], True = the row's own key
        for l in range(self.num_layers):
            layer = self.model.model.layers[l]
            if (kind := self.rope_kinds[l]) not in tables:
                tables[kind] = self._rope(h, pos, l)  # each [B, 1, head_dim]
            if (window := self.windows[l]) not in masks:
                seen = k <= last if window is None else (k <= last) & (k > last - window)  # [B, keys]
                masks[window] = seen[:, None, None, :]
            h = layer(h, attention_mask=masks[window], position_ids=pos, position_embeddings=tables[kind],
                      **hf_cache.layer_kwargs(layer, slots))
        return self.logits(h)[:, -1]  # [B, 1, vocab] -> [B, vocab]

    def run_sparse_layer(
        self, h: torch.Tensor, layer: int, cache: Any, positions: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Run one layer on tokens at arbitrary `positions` [1, n] (h [1, n, D]) with an explicit
        boolean visibility `allowed` [1, 1, n, past+n] over (cache contents + these tokens).
        Used by token-level recompute, where the recomputed tokens are scattered. The cache holds
        positions 0..past-1 in order; a sliding-window layer further limits `allowed` to its window."""
        if self.select is not None:
            self.select()
        cos, sin = self._rope(h, positions, layer)  # each [1, n, head_dim]
        if (window := self.windows[layer]) is not None:
            past = allowed.shape[-1] - positions.shape[1]
            keys = torch.cat([torch.arange(past, device=positions.device), positions[0]])  # [past + n] key positions
            allowed = allowed & attention.visible(positions[0], keys, window)  # [1, 1, n, past + n]
        impl = self.config._attn_implementation
        mask = allowed if impl in ("sdpa", attention.NAME) else additive(allowed, h.dtype)
        block = self.model.model.layers[layer]
        return block(h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                     **hf_cache.layer_kwargs(block, cache))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """E_L [1, T, D] -> logits [1, T, vocab] (final norm, LM head, the final soft cap where the
        config has one), in float32."""
        if self.select is not None:
            self.select()
        logits = self.model.lm_head(self.model.model.norm(h))  # [1, T, vocab]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # as the model's own forward: cap * tanh(logits / cap), in the model's dtype
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

def load_model(
    path: str | os.PathLike,
    *,
    device: str = DEFAULT_DEVICE,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = attention.NAME,
    name: str | None = None,
) -> ModelAdapter:
    """Load a local HF checkpoint (config + weights [+ tokenizer]) onto `device`; never touches
    the hub. `dtype` None follows the device (see `shared/model/device.py`).

    A directory holding `adapter_config.json` is a PEFT adapter (LoRA and the other adapter types
    peft can merge into their base, e.g. DoRA, IA3, LoHa): its base is loaded and the adapter
    merged, so the result is an ordinary model with the adapter's weights. Prompt-learning
    adapters (prefix / prompt tuning) add virtual tokens and are refused.
    """
    dev = resolve_device(device)  # first: a missing GPU is a ConfigError before any file is read
    p = local_path(path)
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise CheckpointNotFoundError(f"no local checkpoint at {p} (expected config.json); DroidMesh never downloads")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise UnsupportedModelError(f"attention implementation {attn_implementation!r}; use {ATTN_IMPLEMENTATIONS}")
    kw = dict(dtype=resolve_dtype(dtype, dev), attn_implementation=attn_implementation, local_files_only=True)
    if (p / RANDOM_INIT).is_file():
        return ModelAdapter(model=_random_init(p, kw, dev), tokenizer=load_tokenizer(p), name=name or p.name)
    if (p / "adapter_config.json").is_file():
        model = _load_lora(p, kw)
    else:
        model_type = AutoConfig.from_pretrained(p, local_files_only=True).model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"{p}: model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
        model = AutoModelForCausalLM.from_pretrained(p, **kw)
    tok = load_tokenizer(p)
    # Weights are read (and a LoRA merged) on the CPU, then moved once: the engine's tensors are
    # all born on `model.device` from here on.
    moved = model.to(dev)  # type: ignore[arg-type]  # transformers' stub wraps Module.to, mypy misreads it
    return ModelAdapter(model=moved, tokenizer=tok, name=name or p.name)


def _random_init(p: Path, kw: dict[str, Any], dev: torch.device) -> PreTrainedModel:
    """A checkpoint of a named shape without weights: its config random-initialised on `dev`
    itself with the checkpoint's seed (an 8B model is built in seconds on a GPU, never copied
    from the host). The same checkpoint on the same device gives the same weights."""
    seed = json.loads((p / RANDOM_INIT).read_text())["seed"]
    config = AutoConfig.from_pretrained(p, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{p}: model_type {config.model_type!r} not in {SUPPORTED_MODEL_TYPES}")
    torch.manual_seed(int(seed))
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=kw["attn_implementation"], dtype=kw["dtype"])
    return model.eval()


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


def load_tokenizer(p: Path) -> Any | None:
    """The tokenizer of the checkpoint in `p`, else of its LoRA base; None when neither has one."""
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
    base = local_path(raw)
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
