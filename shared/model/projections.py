"""A decoder layer's attention pieces outside its forward, as `ModelAdapter` methods.

`LayerProjections` is mixed into `ModelAdapter` (`adapter.py`): layer l's normalized attention
input (`attn_input`) and that norm's weights (`attn_norm`), the K/V the layer's own projections
and RoPE make of such an input (`project_kv`), and the RoPE tables themselves (`rope_tables`).
Called on the engine's worker thread by SCD's patch layers (`shared/kv/scd.py`), translation
(`shared/kv/translate.py`), the screen and the profilers fitting them; each blocks while torch
computes and trusts the adapter's model (checked when the adapter was made).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.model.fingerprint import ArchFingerprint


class LayerProjections:
    """What it reads of its host (`ModelAdapter` sets each): the model, its name, the view's
    `select`, the fingerprint and every layer's RoPE kind."""

    model: PreTrainedModel
    name: str
    select: Callable[[], None] | None
    fingerprint: ArchFingerprint
    rope_kinds: tuple[str | None, ...]

    def attn_input(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """E_layer [1, T, D] -> layer `layer`'s normalized attention input [1, T, D]."""
        if self.select is not None:
            self.select()
        return self.model.model.layers[layer].input_layernorm(h)

    def attn_norm(self, layer: int) -> tuple[torch.Tensor, float]:
        """(weight [D], epsilon) of layer `layer`'s input RMSNorm (what `attn_input` applies), in
        the form weight * x / sqrt(mean(x²) + eps). Gemma stores the weight as an offset from 1
        (its norm scales by 1 + w): the weight returned is that 1 + w."""
        if self.select is not None:
            self.select()
        norm = self.model.model.layers[layer].input_layernorm
        weight = norm.weight.detach()
        if self.model.config.model_type == "gemma3_text":
            weight = 1.0 + weight.float()  # float32, as Gemma's norm computes it
        eps = getattr(norm, "variance_epsilon", None)
        return weight, float(eps if eps is not None else norm.eps)

    def project_kv(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A normalized attention input x [1, T, D] at positions 0..T-1 -> layer `layer`'s K, V
        [1, kv_heads, T, head_dim], by the same operations as the layer's own forward (K/V
        projections, the per-head K norm of Qwen3 and Gemma 3, the layer's RoPE), so the true input
        gives the layer's own KV."""
        if self.select is not None:
            self.select()
        attn = self.model.model.layers[layer].self_attn
        t, hd = x.shape[1], self.fingerprint.head_dim
        k = attn.k_proj(x).view(1, t, -1, hd)  # [1, T, kvh, hd]
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)  # [1, kvh, T, hd]
        v = attn.v_proj(x).view(1, t, -1, hd).transpose(1, 2)  # [1, kvh, T, hd]
        positions = torch.arange(t, device=x.device)[None]  # [1, T]
        cos, sin = self._rope(x, positions, layer)  # each [1, T, hd]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, hd]
        half = hd // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)  # rotate_half(k)
        return k * cos + rotated * sin, v

    def rope_tables(self, layer: int | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim / 2] float32 on the CPU, attention scaling): layer `layer`'s RoPE.
        Without a layer: the RoPE every layer shares; a model whose RoPE differs per layer type
        (Gemma 3) refuses that, so no caller silently rotates a global layer by the local base."""
        if self.select is not None:
            self.select()
        rot = self.model.model.rotary_emb
        if layer is None:
            if len(set(self.rope_kinds)) > 1:
                raise UnsupportedModelError(f"{self.name}: RoPE differs per layer type; ask for it per layer")
            layer = 0
        kind = self.rope_kinds[layer]
        prefix = "" if kind is None else f"{kind}_"  # Gemma 3 keeps `{layer_type}_inv_freq` per type
        return getattr(rot, f"{prefix}inv_freq").detach().float().cpu(), float(getattr(rot, f"{prefix}attention_scaling"))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [1, T, head_dim], of layer `layer`'s RoPE at `positions` [1, T]."""
        kind = self.rope_kinds[layer]
        rot = self.model.model.rotary_emb
        return rot(x, positions) if kind is None else rot(x, positions, kind)
