"""Comparing tensors that two computations of the same values produced.

Two computations agree to the bit only when they run the same kernels on the same shapes in the
same order. A pass padded to a token bucket, rows decoded in one batch, a masked attention over a
pool's padded slots: each lets the math library split and order its sums differently, and how it
does so depends on the shape, the CPU's vendor and vector width, or the GPU. The results then
differ in their last bits, and by how much is a matter of the dtype and the depth of the model.

So a test that holds two such computations to each other compares them with
`assert_close_computed`, within a tolerance derived from the dtype; `torch.equal` is for copied
bytes and for computations that are the same by design, and every use says which with a
`# bitwise: <why>` mark (`tests/unit/infra/test_exact_comparisons.py` holds the tests to that).
"""

from __future__ import annotations

import math

import torch

# The tolerance, in units of the dtype's eps per layer the values went through. Summed in another
# order, a dot product of inner size K moves by about sqrt(K) eps of its terms' scale (K = 64-128
# in the tests' models: 8-11 eps); a layer chains a few of them (q/k/v, the attention, o, the MLP)
# and carries what the earlier layers left. Measured: at most 3.5 eps over 6 layers for layer
# graphs against eager passes, 10 eps for batched against solo decode. A wrong value (a stale
# buffer, a wrong position, a skipped restore) moves logits by a sizable fraction of their scale:
# orders of magnitude above this.
EPS_PER_LAYER = 32


def computed_tolerance(dtype: torch.dtype, layers: int) -> float:
    """The largest `relative_diff` allowed between two computations of the same values in `dtype`
    through `layers` layers that ran different kernels or shapes."""
    return torch.finfo(dtype).eps * EPS_PER_LAYER * max(layers, 1)


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: rounding scales with the terms a value is summed from,
    not with the value, so an element near zero is held to the tensor's scale (0 if equal)."""
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()
    diff = float((got - want).abs().max())
    if diff == 0.0:
        return 0.0
    scale = float(want.abs().max())
    return diff / scale if scale > 0 else math.inf


def assert_close_computed(got: torch.Tensor, want: torch.Tensor, *, dtype: torch.dtype, layers: int,
                          what: str = "") -> None:
    """`got` and `want`, finite, within `computed_tolerance(dtype, layers)` of each other; `dtype`
    is the one the values were computed in (logits are handed out in float32 either way)."""
    for name, t in (("got", got), ("want", want)):
        if not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{what}: {name} is not finite")
    rel, tol = relative_diff(got, want), computed_tolerance(dtype, layers)
    if rel > tol:
        raise AssertionError(f"{what}: max |got - want| / max |want| = {rel:.3g} > {tol:.3g} "
                             f"({EPS_PER_LAYER} eps of {dtype} x {layers} layers)")
