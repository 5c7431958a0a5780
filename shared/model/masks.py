"""The explicit attention masks of transformers' `sdpa` and `eager` paths.

Called by `ModelAdapter` on the engine's worker thread as it runs layers; each builds a small
tensor on the model's device from lengths the adapter computed itself (nothing here is checked).
A manual layer loop matches the model's own forward exactly when the causal pattern over a
non-empty cache is lower-right aligned (with transformers' sdpa, `attention_mask=None` there
silently aligns it top-left). The default attention (`shared/model/attention.py`) aligns it from
the lengths, with no mask and no K/V head expansion; `sdpa` and `eager` get an explicit mask.
"""

from __future__ import annotations

import torch

from droidmesh.shared.model import attention


def layer_mask(impl: str, past: int, t: int, window: int | None, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
    """What attention implementation `impl` is handed for T new tokens over `past` cached ones in
    a layer of sliding `window` (None: full attention); None where the kernel needs no mask."""
    if impl == attention.NAME:
        return None  # the kernel takes causality and the window from the lengths (`shared/model/attention.py`)
    if window is not None and past + t <= window:
        window = None  # no key is out of any query's window: plain causal
    if past == 0 and window is None and impl == "sdpa":
        return None  # plain causal over an empty cache: sdpa's is_causal path is exact and fast
    return causal_mask(past, t, impl, dtype, device, window)


def causal_mask(past: int, t: int, impl: str, dtype: torch.dtype, device: torch.device,
                window: int | None = None) -> torch.Tensor:
    """Mask [1, 1, T, past+T] letting query i (position past+i) see keys 0..past+i (with a
    sliding `window` W, only the last W of them: past+i-W+1..past+i).

    sdpa takes a boolean mask (True = attend); eager takes an additive float mask.
    """
    q = torch.arange(past, past + t, device=device)  # [T]
    k = torch.arange(past + t, device=device)  # [past+T]
    allowed = attention.visible(q, k, window)[None, None]  # [1, 1, T, past+T]
    return allowed if impl in ("sdpa", attention.NAME) else additive(allowed, dtype)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility -> eager attention's additive mask (0 where visible, -inf-ish elsewhere)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
