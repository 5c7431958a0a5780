"""The translator fit's source-layer search scores every ridge strength from one
eigendecomposition per candidate set (`translate_fit._scores`); it must give what one solve
per λ then the held-out R² by definition give (`_solve`, `_r2`), on well and badly conditioned
features, with a constant feature and with correlated candidate layers (float64: 1e-7)."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.profiling import translate_fit as F


def _folds(k: int, layers: int, dt: int, *, collinear: bool, seed: int = 0) -> tuple[F._Stats, F._Stats]:
    g = torch.Generator().manual_seed(seed)
    folds = []
    mix = torch.randn(k, k, generator=g, dtype=torch.float64)
    truth = torch.randn(k, layers * dt, generator=g, dtype=torch.float64)
    for n in (300, 120):
        x = torch.randn(n, k, generator=g, dtype=torch.float64) @ mix + 3.0  # correlated, off-centre
        if collinear:
            x[:, 1] = x[:, 0] * 2 + 1e-4 * torch.randn(n, generator=g, dtype=torch.float64)  # near-duplicate
            x[:, 2] = 5.0  # a constant feature
        y = x @ truth + torch.randn(n, layers * dt, generator=g, dtype=torch.float64) * 4.0
        st = F._Stats(k, layers + 1, dt)
        st.add(x.float().double(), list(y.reshape(n, layers, dt).unbind(1)))
        folds.append(st)
    return folds[0], folds[1]


def _by_solves(train: F._Stats, held: F._Stats, cols: torch.Tensor, lambdas) -> torch.Tensor:
    g, c = F._sub(train, cols)
    hg, hc = F._sub(held, cols)
    return torch.stack([F._r2(F._solve(g, c, train.n, lam), hg, hc, held) for lam in lambdas])


@pytest.mark.parametrize("collinear", [False, True])
def test_one_eigendecomposition_scores_every_lambda_as_its_own_solve(collinear):
    train, held = _folds(12, 3, 5, collinear=collinear)
    cols = torch.tensor([*range(12), -1])
    got = F._scores(train, held, cols, F.LAMBDAS)
    want = _by_solves(train, held, cols, F.LAMBDAS)
    assert got.shape == (len(F.LAMBDAS), 3)
    assert torch.allclose(got, want, rtol=1e-7, atol=1e-7), (got - want).abs().max()
    assert float(want.max()) > 0.5  # a fit that explains the labels, not a trivially equal pair of zeros


def test_a_subset_of_the_features_scores_as_its_own_solve():
    train, held = _folds(12, 2, 4, collinear=False, seed=1)
    cols = torch.tensor([3, 4, 5, 9, -1])
    assert torch.allclose(F._scores(train, held, cols, (1e-3, 1.0)), _by_solves(train, held, cols, (1e-3, 1.0)),
                          rtol=1e-7, atol=1e-7)
