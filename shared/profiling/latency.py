"""A per-pair latency model fitted from measured receiver prefills (used online by the reuse policy,
`shared/kv/policy.py`).

seconds(T, k) = c0 + c_tok*T + c_layer_tok*T*k + c_attn*T^2*k, fitted by non-negative least
squares (numpy lstsq with an active set; four terms need no solver library) over a small grid
of context lengths T and recomputed layers k: the linear terms are the projections/MLP per
recomputed layer, the quadratic one causal attention, and c_tok the
suffix + everything per token that does not depend on k.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.wire.schemas import LatencyFit


def measure(model: ModelAdapter, tokens: Sequence[int], ks: Sequence[int], repeats: int = 2,
            seed: int = 0) -> list[tuple[int, int, float]]:
    """(T, k, median seconds) of the receiver's partial prefill recomputing k layers of T tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tokens:
        ids = torch.randint(0, model.config.vocab_size, (t + 8,), generator=g).tolist()
        captured = capture_prefill(model, ids[:t], e_layers=[0])
        for k in ks:
            plan = ReusePlan.recompute(0, k) if k else ReusePlan.full_reuse()
            runs = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                prefill(model, ids, plan, CapturedSource(captured))
                runs.append(time.perf_counter() - t0)
            out.append((t, k, statistics.median(runs[1:])))
    return out


def fit(samples: Sequence[tuple[int, int, float]], model: ModelAdapter) -> LatencyFit:
    a = np.array([[1.0, t, t * k, t * t * k] for t, k, _ in samples])
    y = np.array([s for _, _, s in samples])
    coef = _nonneg_lstsq(a, y)
    elem = torch.empty((), dtype=model.dtype).element_size()
    fp = model.fingerprint
    return LatencyFit(c0=float(coef[0]), c_tok=float(coef[1]), c_layer_tok=float(coef[2]), c_attn=float(coef[3]),
                      kv_bytes_per_token_layer=2 * fp.num_kv_heads * fp.head_dim * elem,
                      e_bytes_per_token=fp.hidden_size * elem)


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative term and refit until none is."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef
