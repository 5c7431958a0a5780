"""The translator fit's bottleneck directions (`translate_fit._directions`) come from k x k
problems; they span what the eigenvectors of the fitted outputs' out x out covariance span
(the definition), so each rank's reduced maps are the same (float64: 1e-8 relative)."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.profiling import translate_fit as F


def _problem(k: int, layers: int, dt: int, n: int = 400, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float64) @ torch.randn(k, k, generator=g, dtype=torch.float64)
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)  # [n, k+1]
    w = torch.randn(k + 1, layers, dt, generator=g, dtype=torch.float64)  # [k+1, Lt-1, Dt]
    return w, xt.T @ xt


def _by_definition(w: torch.Tensor, g: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    k = w.shape[0] - 1
    wx = w[:-1].reshape(k, -1)
    mean = g[-1, :-1] / n
    cov = g[:-1, :-1] / n - torch.outer(mean, mean)
    _, vecs = torch.linalg.eigh(wx.T @ cov @ wx)  # [out, out], ascending
    return vecs[:, -rank:]


@pytest.mark.parametrize(("k", "layers", "dt"), [(12, 3, 10), (40, 2, 8)])  # out > k, and out < k
def test_directions_span_the_covariances_top_eigenvectors(k, layers, dt):
    w, g = _problem(k, layers, dt)
    dirs = F._directions(w, g, 400)
    assert torch.allclose(dirs.T @ dirs, torch.eye(dirs.shape[1], dtype=torch.float64), atol=1e-8)
    for rank in (2, 5, min(k, layers * dt) - 1):
        want = _by_definition(w, g, 400, rank)
        got = dirs[:, :rank]
        assert torch.allclose(got @ got.T, want @ want.T, atol=1e-8), rank  # the same subspace (projectors)
        new, old = F._reduced(w, g, 400, rank, dirs)[0], F._reduced(w, g, 400, rank)[0]
        assert torch.allclose(new, old, rtol=1e-8, atol=1e-8 * float(w.abs().max()))
