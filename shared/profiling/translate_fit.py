"""Fitting a `Translator` (closed-form ridge) from calibration contexts, offline (`droidmesh
profile --translate`: a translated pair's profile is its translator).

Sequence:
  1. per context: both models tokenize it (`text.context_spans`), `translate.align` maps target
     tokens to source spans, both prefill it keeping E at every layer;
  2. per source layer s, the source E pooled onto the target's tokens is X_s [T_t, Ds] (the start
     token left out: the target keeps its own); per target layer l the labels are the target's
     own E_l [T_t, Dt];
  3. only sufficient statistics are kept, per fold (the last `holdout` share of contexts is held
     out): G_s = X̃_sᵀX̃_s, C_sl = X̃_sᵀY_l with X̃ = [X, 1], and Y's sums, so memory does not grow
     with the number of tokens;
  4. per target layer l >= 1: for every source layer s and ridge strength λ, solve on the train
     fold, score R² on the held-out fold; keep the best (s, λ) ("layer correspondence by fit"),
     refit on both folds.
The ridge penalty is λ·n·var(x_j) on feature j's weights, so λ does not depend on the scale of the
source's hidden states.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.translate import Translator, align, pool
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.text import context_spans, tokenizer_spec
from droidmesh.shared.tasks.spec import TaskSpec
from droidmesh.shared.tasks.translated import evaluate_translated

LAMBDAS = (1e-4, 1e-3, 1e-2, 1e-1)


class _Stats:
    """Sufficient statistics of one fold, float64."""

    def __init__(self, ls: int, lt: int, ds: int, dt: int):
        self.g = torch.zeros(ls, ds + 1, ds + 1, dtype=torch.float64)        # [Ls, Ds+1, Ds+1]
        self.c = torch.zeros(ls, lt, ds + 1, dt, dtype=torch.float64)        # [Ls, Lt, Ds+1, Dt]
        self.yy = torch.zeros(lt, dtype=torch.float64)                       # Σ ||y||² per target layer
        self.ysum = torch.zeros(lt, dt, dtype=torch.float64)                 # Σ y per target layer
        self.n = 0

    def add(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        """xs: per source layer [N, Ds]; ys: per target layer [N, Dt]."""
        y = torch.stack(ys).double()  # [Lt, N, Dt]
        for s, x in enumerate(xs):
            xt = torch.cat([x.double(), x.new_ones(x.shape[0], 1, dtype=torch.float64)], 1)  # [N, Ds+1]
            self.g[s] += xt.T @ xt
            self.c[s] += torch.einsum("nd,lnt->ldt", xt, y)
        self.yy += (y * y).sum((1, 2))
        self.ysum += y.sum(1)
        self.n += y.shape[1]

    def merged(self, other: _Stats) -> _Stats:
        out = _Stats(1, 1, 1, 1)
        out.g, out.c, out.yy, out.ysum, out.n = (self.g + other.g, self.c + other.c, self.yy + other.yy,
                                                 self.ysum + other.ysum, self.n + other.n)
        return out


def _solve(g: torch.Tensor, c: torch.Tensor, n: int, lam: float) -> torch.Tensor:
    """Ridge weights W̃ [Ds+1, Dt] (bias last) from G [Ds+1, Ds+1], C [Ds+1, Dt]."""
    mean = g[-1, :-1] / n
    var = (torch.diagonal(g)[:-1] / n - mean * mean).clamp_min(1e-12)
    penalty = torch.cat([lam * n * var, var.new_zeros(1)])
    return torch.linalg.solve(g + torch.diag(penalty), c)


def _r2(w: torch.Tensor, st: _Stats, s: int, l: int) -> float:
    """1 - SSE/SST of W̃ on a fold, from its statistics alone."""
    sse = st.yy[l] - 2 * (w * st.c[s, l]).sum() + (w * (st.g[s] @ w)).sum()
    sst = st.yy[l] - (st.ysum[l] ** 2).sum() / st.n
    return float(1 - sse / sst)


def fit(source: ModelAdapter, target: ModelAdapter, contexts: Sequence[str], *, holdout: float = 0.25,
        lambdas: Sequence[float] = LAMBDAS, progress: Callable[[int], None] | None = None) -> Translator:
    """A translator from `source`'s E to `target`'s, fit on `contexts` (texts); `progress` is
    called with the number of contexts done."""
    if source.tokenizer is None or target.tokenizer is None:
        raise BadRequestError("fitting a translator needs both models' tokenizers")
    n_hold = max(1, int(len(contexts) * holdout))
    if len(contexts) - n_hold < 1:
        raise BadRequestError(f"need at least 2 calibration contexts, got {len(contexts)}")
    t0 = time.perf_counter()
    ls, lt = source.num_layers, target.num_layers
    ds, dt = source.config.hidden_size, target.config.hidden_size
    folds = [_Stats(ls, lt, ds, dt), _Stats(ls, lt, ds, dt)]
    start_e: torch.Tensor | None = None
    start_id = -1
    for i, text in enumerate(contexts):
        s_ids, s_spans = context_spans(source.tokenizer, text)
        t_ids, t_spans = context_spans(target.tokenizer, text)
        spans = align(s_spans, t_spans)
        s_cap = capture_prefill(source, s_ids, e_layers=range(ls))
        t_cap = capture_prefill(target, t_ids, e_layers=range(lt))
        rows = slice(1, None) if t_spans and t_spans[0] is None else slice(0, None)
        if start_e is None and rows.start == 1:
            start_e, start_id = torch.stack([t_cap.e[l][0, 0].float().cpu() for l in range(lt)]), t_ids[0]
        xs = [pool(s_cap.e[s][0].cpu(), spans)[rows] for s in range(ls)]  # per s: [N, Ds]
        ys = [t_cap.e[l][0, rows].float().cpu() for l in range(lt)]  # per l: [N, Dt]
        folds[int(i >= len(contexts) - n_hold)].add(xs, ys)
        if progress is not None:
            progress(i + 1)
    train, held = folds
    both = train.merged(held)
    chosen: list[tuple[int, float, float]] = []  # per target layer >= 1: (source layer, λ, held-out R²)
    ws, bs = [], []
    for l in range(1, lt):
        best = max(((s, lam, _r2(_solve(train.g[s], train.c[s, l], train.n, lam), held, s, l))
                    for s in range(ls) for lam in lambdas), key=lambda t: t[2])
        chosen.append(best)
        w = _solve(both.g[best[0]], both.c[best[0], l], both.n, best[1]).float()  # [Ds+1, Dt]
        ws.append(w[:-1].contiguous())
        bs.append(w[-1].contiguous())
    info: dict[str, Any] = {
        "kind": "ridge", "contexts": len(contexts), "held_out_contexts": n_hold, "tokens": both.n,
        "r2_held_out": [round(r, 4) for _, _, r in chosen], "lambda": [lam for _, lam, _ in chosen],
        "fit_s": round(time.perf_counter() - t0, 2),
    }
    return Translator(source.name, target.name, source.fingerprint, target.fingerprint,
                      (-1, *(s for s, _, _ in chosen)), tuple(ws), tuple(bs),
                      start_e if start_e is not None else torch.zeros(lt, dt), start_id, info,
                      tokenizer_spec(source.tokenizer))


def profile_translated(source: ModelAdapter, target: ModelAdapter, train_contexts: Sequence[str],
                       test_rows: Sequence[dict[str, Any]], spec: TaskSpec, translator_path: Path) -> dict[str, Any]:
    """`droidmesh profile --translate`: fit on `train_contexts` (progress bar), save the
    translator at `translator_path`, score it on `test_rows` (`tasks.translated`)."""
    with tqdm(total=len(train_contexts), desc="fit translator", unit="context") as bar:
        translator = fit(source, target, train_contexts, progress=lambda n: bar.update(n - bar.n))
    translator_path.parent.mkdir(parents=True, exist_ok=True)
    sha = translator.save(translator_path)
    result = evaluate_translated(source, target, translator, test_rows, spec)
    result.update(translator_file=translator_path.name, translator_sha256=sha,
                  translator_bytes=translator_path.stat().st_size)
    return result
