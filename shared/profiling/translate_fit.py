"""Fitting a `Translator` (closed-form ridge) from calibration contexts, offline (`droidmesh
profile --translate`: a translated pair's profile is its translator).

Sequence:
  1. per context: both models tokenize it (`text.context_spans`), `translate.align` maps target
     tokens to source spans, both prefill it keeping E at every layer;
  2. features: for each candidate source layer (the lowest `CANDIDATES`), its E normalised by that
     layer's input RMSNorm and pooled onto the target's tokens, with the previous target token's
     row (`translate.features`) [T_t, 2 * candidates * Ds]; labels: per target layer l >= 1 the
     target's own normalised attention input x_l [T_t, Dt] (what its K/V projections read); the
     start token is left out (the target keeps its own);
  3. only sufficient statistics are kept, per fold (the last `holdout` share of contexts is held
     out): G = X̃ᵀX̃, C = X̃ᵀY with X̃ = [X, 1], and Y's sums, so memory does not grow with tokens;
  4. source layers are chosen greedily (up to `MAX_SOURCES`, while the held-out R² averaged over
     target layers gains): each candidate set is one solve on the sub-statistics of its features,
     for every target layer at once; each target layer then keeps its own ridge strength λ;
  5. reduced-rank regression: all target layers' maps go through one shared bottleneck of r
     numbers per token, the top directions of the fitted outputs' covariance (the smallest of
     `RANKS` within `MAX_RANK_LOSS` of full rank on every layer, from the same statistics), so each layer's map
     reads r numbers, not 2 * sources * Ds: the translation's cost on the target. (Principal
     directions of the features alone lost 0.15-0.3 of R² at rank 128: what the target needs is
     not where the features vary most.) Then the maps are refit on both folds.
The ridge penalty is λ·n·var(x_j) on feature j's weights, so λ does not depend on the scale of
the source's states.
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
from droidmesh.shared.kv.translate import Translator, align, features, pooled_inputs
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.text import context_spans, tokenizer_spec
from droidmesh.shared.tasks.spec import TaskSpec
from droidmesh.shared.tasks.translated import evaluate_translated

LAMBDAS = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)  # ridge strengths: λ·n·var(x_j)
CANDIDATES = 8    # lowest source layers considered: what a lookup binds on sits low; bounds the statistics
MAX_SOURCES = 3   # source layers a translator reads at most (the bytes a receiver pulls)
MIN_GAIN = 0.002  # held-out R² a further source layer must add
RANKS = (32, 64, 96, 128, 192)  # shared bottlenecks tried, smallest first (each layer's map then reads r numbers)
MAX_RANK_LOSS = 0.01   # held-out R² a bottleneck may cost any target layer


class _Stats:
    """Sufficient statistics of one fold, float64 (target layers 1..; layer 0 is never mapped)."""

    def __init__(self, f: int, lt: int, dt: int):
        self.g = torch.zeros(f + 1, f + 1, dtype=torch.float64)           # [F+1, F+1]
        self.c = torch.zeros(f + 1, lt - 1, dt, dtype=torch.float64)      # [F+1, Lt-1, Dt]
        self.yy = torch.zeros(lt - 1, dtype=torch.float64)                # Σ ||y||² per target layer
        self.ysum = torch.zeros(lt - 1, dt, dtype=torch.float64)          # Σ y per target layer
        self.n = 0

    def add(self, x: torch.Tensor, ys: list[torch.Tensor]) -> None:
        """x: features [N, F]; ys: per target layer >= 1, [N, Dt]."""
        xt = torch.cat([x.double(), x.new_ones(x.shape[0], 1, dtype=torch.float64)], 1)  # [N, F+1]
        y = torch.stack(ys).double()  # [Lt-1, N, Dt]
        self.g += xt.T @ xt
        self.c += torch.einsum("nd,lnt->dlt", xt, y)
        self.yy += (y * y).sum((1, 2))
        self.ysum += y.sum(1)
        self.n += y.shape[1]

    def absorb(self, other: _Stats) -> None:
        """Add `other`'s statistics into these (the refit on both folds)."""
        self.g += other.g
        self.c += other.c
        self.yy += other.yy
        self.ysum += other.ysum
        self.n += other.n


def _columns(layers: Sequence[int], ds: int) -> torch.Tensor:
    """Feature columns of candidate source layers `layers` (ascending), then the bias column."""
    cols = [c for s in layers for c in range(2 * s * ds, 2 * (s + 1) * ds)]
    return torch.tensor(cols + [-1])


def _sub(st: _Stats, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, C) of the features `cols` (bias last)."""
    return st.g[cols][:, cols], st.c[cols]  # [k+1, k+1], [k+1, Lt-1, Dt]


def _solve(g: torch.Tensor, c: torch.Tensor, n: int, lam: float) -> torch.Tensor:
    """Ridge weights W̃ [k+1, Lt-1, Dt] (bias row last) from G [k+1, k+1] and C [k+1, Lt-1, Dt]:
    one factorisation for every target layer at once."""
    mean = g[-1, :-1] / n
    var = (torch.diagonal(g)[:-1] / n - mean * mean).clamp_min(1e-12)
    penalty = torch.cat([lam * n * var, var.new_zeros(1)])
    return torch.linalg.solve(g + torch.diag(penalty), c.reshape(c.shape[0], -1)).reshape(c.shape)


def _r2(w: torch.Tensor, g: torch.Tensor, c: torch.Tensor, st: _Stats) -> torch.Tensor:
    """Per target layer 1 - SSE/SST of W̃ on a fold (its G, C and `st`'s label sums): [Lt-1]."""
    gw = torch.einsum("de,elt->dlt", g, w)
    sse = st.yy - 2 * (w * c).sum((0, 2)) + (w * gw).sum((0, 2))
    sst = st.yy - (st.ysum ** 2).sum(1) / st.n
    return 1 - sse / sst


def _scores(train: _Stats, held: _Stats, cols: torch.Tensor, lambdas: Sequence[float]) -> torch.Tensor:
    """Held-out R² [len(lambdas), Lt-1] of the maps from the features `cols`, what `_solve` then
    `_r2` give for each λ, from one eigendecomposition for every λ (the search's cost no longer
    grows with the grid). With the bias unpenalised the ridge map is w = P (Λ + λ)⁻¹ B: Sc the
    centred Gram matrix, D² = diag(Sc) (the penalty's n·var), D⁻¹ Sc D⁻¹ = Q Λ Qᵀ, P = D⁻¹ Q,
    B = Pᵀ Cc. On the held-out fold, centred by the training means (u = x - x̄, v = y - ȳ), a
    target layer's SSE = Σ‖v‖² - 2 Σ_i s_i e_i + sᵀ (H ∘ B Bᵀ) s with s = 1 / (Λ + λ),
    e = Σ_t (Pᵀ Σuᵀv)_t ∘ B_t and H = Pᵀ Σuᵀu P: per λ only k-vectors and one k x k product."""
    g, c = _sub(train, cols)  # [k+1, k+1], [k+1, Lt-1, Dt]
    hg, hc = _sub(held, cols)
    n, nh = train.n, held.n
    k, layers, dt = g.shape[0] - 1, c.shape[1], c.shape[2]
    mean, ybar = g[-1, :-1] / n, (c[-1] / n).reshape(-1)  # x̄ [k], ȳ [R = (Lt-1) * Dt]
    sc = g[:-1, :-1] - n * torch.outer(mean, mean)  # [k, k]
    dinv = (torch.diagonal(sc) / n).clamp_min(1e-12).mul(n).rsqrt()  # D⁻¹ [k], `_solve`'s var floor
    lam_e, q = torch.linalg.eigh(sc * dinv[:, None] * dinv[None, :])  # Λ [k], Q [k, k]
    p = dinv[:, None] * q  # P [k, k]
    b = p.T @ (c[:-1].reshape(k, -1) - n * torch.outer(mean, ybar))  # B [k, R]
    sh, syh = hg[-1, :-1], hc[-1].reshape(-1)  # held Σx [k], Σy [R]
    uu = hg[:-1, :-1] - torch.outer(mean, sh) - torch.outer(sh, mean) + nh * torch.outer(mean, mean)  # [k, k]
    uv = hc[:-1].reshape(k, -1) - torch.outer(mean, syh) - torch.outer(sh, ybar) + nh * torch.outer(mean, ybar)
    e = ((p.T @ uv) * b).reshape(k, layers, dt).sum(2)  # [k, Lt-1]
    del uv
    h = p.T @ uu @ p  # H [k, k]
    vv = held.yy - 2 * (ybar * syh).reshape(layers, dt).sum(1) + nh * (ybar * ybar).reshape(layers, dt).sum(1)
    s = 1 / (lam_e[None, :].clamp_min(0) + torch.tensor(lambdas, dtype=lam_e.dtype)[:, None])  # [λ, k]
    quad = torch.stack([((s @ (h * (b_l @ b_l.T))) * s).sum(1)
                        for b_l in b.reshape(k, layers, dt).unbind(1)], 1)  # [λ, Lt-1]
    sse = vv[None] - 2 * s @ e + quad
    sst = held.yy - (held.ysum ** 2).sum(1) / held.n
    return 1 - sse / sst[None]


def _maps(g: torch.Tensor, c: torch.Tensor, n: int, lams: Sequence[float]) -> torch.Tensor:
    """Each target layer's full-rank ridge map with its own λ: W̃ [k+1, Lt-1, Dt] (bias row last)."""
    return torch.stack([_solve(g, c[:, l:l + 1], n, lam)[:, 0] for l, lam in enumerate(lams)], 1)


def _directions(w: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    """The principal directions of the full-rank maps' fitted outputs, [out, m] (out = (Lt-1) * Dt,
    m <= k, largest variance first): the eigenvectors of their covariance M = Wxᵀ Σ Wx [out, out].
    M has rank <= k, so they come from k x k problems: Σ = R Rᵀ, B = Rᵀ Wx [k, out], M = Bᵀ B,
    and M's eigenvectors are Bᵀ u / s for B Bᵀ's eigenpairs (u, s²). At real widths out is
    (17..29) * (576..640) ≈ 11-17K, k ≈ 1-3.5K: no out x out matrix is formed or factored."""
    k = w.shape[0] - 1
    wx = w[:-1].reshape(k, -1)  # [k, out]
    mean = g[-1, :-1] / n  # [k]
    cov = g[:-1, :-1] / n - torch.outer(mean, mean)  # [k, k]
    lam, q = torch.linalg.eigh(cov)
    b = (q * lam.clamp_min(0).sqrt()).T @ wx  # [k, out]
    s2, u = torch.linalg.eigh(b @ b.T)  # ascending
    s2, u = s2.flip(0), u.flip(1)  # largest first
    keep = s2 > s2[0].clamp_min(0) * 1e-12  # directions with variance (the rest are numerically null)
    return (b.T @ u[:, keep]) / s2[keep].sqrt()  # [out, m], unit columns


def _reduced(w: torch.Tensor, g: torch.Tensor, n: int, rank: int | None, dirs: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """The full-rank maps `w` (`_maps`) through one shared rank-`rank` bottleneck (reduced-rank
    regression: the top directions of the fitted outputs' covariance, `dirs` = `_directions(w, g, n)`
    when computed already; None: full rank). Returns the equivalent full maps W̃ [k+1, Lt-1, Dt]
    (to score them), the projection [k+1, rank] of the augmented features onto the bottleneck
    (None: full rank), and per target layer the map [rank or k, Dt] and bias [Dt] the translator
    applies."""
    layers, dt = w.shape[1], w.shape[2]
    if rank is None:
        return w, None, [w[:-1, l] for l in range(layers)], [w[-1, l] for l in range(layers)]
    k = w.shape[0] - 1
    wx, bias = w[:-1].reshape(k, layers * dt), w[-1].reshape(layers * dt)
    mean = g[-1, :-1] / n  # [k]
    v = (dirs if dirs is not None else _directions(w, g, n))[:, :rank]  # [out, rank]
    a = wx @ v  # [k, rank]
    proj = torch.cat([a, (-mean @ a)[None]])  # [k+1, rank]: z = (x - mean) @ a
    offset = bias + mean @ wx  # [out]: x̂ = z @ vᵀ + offset
    equiv = torch.cat([a @ v.T, (offset - mean @ a @ v.T)[None]]).reshape(w.shape)
    maps = [v[l * dt:(l + 1) * dt].T for l in range(layers)]  # per layer [rank, Dt]
    return equiv, proj, maps, [offset[l * dt:(l + 1) * dt] for l in range(layers)]


def fit(source: ModelAdapter, target: ModelAdapter, contexts: Sequence[str], *, holdout: float = 0.25,
        lambdas: Sequence[float] = LAMBDAS, progress: Callable[[int], None] | None = None,
        weights: tuple[str, str] = ("", ""), candidates: int = CANDIDATES,
        ranks: Sequence[int] = RANKS) -> Translator:
    """A translator from `source`'s E to `target`'s attention inputs, fit on `contexts` (texts);
    `progress` is called with the number of contexts done; `weights`: the (source, target)
    weights' sha256 it is bound to ("": unbound); `candidates`: the lowest source layers
    considered; `ranks`: the shared bottlenecks tried (empty: full-rank maps).

    Memory: F = 2 * candidates * Ds features; G (F+1)² and C (F+1) * (Lt-1) * Dt float64 per fold,
    two folds: ~0.1 GB for the zoo; at 8 candidates SmolLM2 (576) -> Gemma 3 270M (640, 18
    layers) 1.5 GB per fold, Gemma -> SmolLM2 (30 layers) 2.2 GB; two 4096-wide 32-layer models
    34 + 67 GB per fold (fewer candidates, or features projected to fewer dimensions per source
    layer before the statistics: not built). The bottleneck's directions come from k x k
    problems (`_directions`), never an out x out one."""
    if source.tokenizer is None or target.tokenizer is None:
        raise BadRequestError("fitting a translator needs both models' tokenizers")
    n_hold = max(1, int(len(contexts) * holdout))
    if len(contexts) - n_hold < 1:
        raise BadRequestError(f"need at least 2 calibration contexts, got {len(contexts)}")
    lt, ds, dt = target.num_layers, source.config.hidden_size, target.config.hidden_size
    layers = range(min(candidates, source.num_layers))
    norms = [source.attn_norm(l) for l in range(source.num_layers)]
    train, held, start_x, start_id = _statistics(source, target, contexts, n_hold, layers, norms, progress)
    sources, best = _choose_sources(train, held, layers, ds, lambdas, lt - 1)
    cols = _columns(sources, ds)
    lam_of = [lambdas[int(i)] for i in best.argmax(0)]  # per target layer >= 1
    rank, by_rank = _choose_rank(train, held, cols, lam_of, best.max(0).values, ranks)
    train.absorb(held)
    g, c = _sub(train, cols)
    _, proj, maps, biases = _reduced(_maps(g, c, train.n, lam_of), g, train.n, rank)
    ws, bs = [m.float().contiguous() for m in maps], [b.float().contiguous() for b in biases]
    info: dict[str, Any] = {
        "kind": "ridge", "contexts": len(contexts), "held_out_contexts": n_hold, "tokens": train.n,
        "candidates": len(layers),
        "r2_held_out": [round(float(r), 4) for r in best.max(0).values], "lambda": lam_of, "rank": rank, "r2_by_rank": by_rank,
    }
    return Translator(source.name, target.name, source.fingerprint, target.fingerprint, tuple(sources),
                      tuple(ws), tuple(bs), None if proj is None else proj.float().contiguous(),
                      start_x if start_x is not None else torch.zeros(lt, dt), start_id,
                      torch.stack([w.float().cpu() for w, _ in norms]), norms[0][1], info,
                      tokenizer_spec(source.tokenizer), *weights)


def _statistics(source: ModelAdapter, target: ModelAdapter, contexts: Sequence[str], n_hold: int, layers: range,
                norms: list[tuple[torch.Tensor, float]], progress: Callable[[int], None] | None
                ) -> tuple[_Stats, _Stats, torch.Tensor | None, int]:
    """Steps 1-3 over every context: the training fold's statistics and the held-out fold's (the
    last `n_hold` contexts), then the target's own start-token attention inputs [Lt, Dt] and its
    token id, from the first context whose first target token matches no source span (None, -1:
    none did). `norms`: each source layer's input RMSNorm (`attn_norm`)."""
    lt, ds, dt = target.num_layers, source.config.hidden_size, target.config.hidden_size
    folds = [_Stats(2 * len(layers) * ds, lt, dt), _Stats(2 * len(layers) * ds, lt, dt)]
    start_x: torch.Tensor | None = None
    start_id = -1
    for i, text in enumerate(contexts):
        s_ids, s_spans = context_spans(source.tokenizer, text)
        t_ids, t_spans = context_spans(target.tokenizer, text)
        spans = align(s_spans, t_spans)
        s_cap = capture_prefill(source, s_ids, e_layers=layers)
        t_cap = capture_prefill(target, t_ids, e_layers=range(lt))
        rows = slice(1, None) if t_spans and t_spans[0] is None else slice(0, None)
        with torch.inference_mode():
            labels = [target.attn_input(t_cap.e[l], l)[0].float().cpu() for l in range(lt)]  # per l: [T_t, Dt]
            x = features([pooled_inputs(s_cap.e[s][0], norms[s][0], norms[s][1], spans).cpu() for s in layers])
        if start_x is None and rows.start == 1:
            start_x, start_id = torch.stack([y[0] for y in labels]), t_ids[0]
        folds[int(i >= len(contexts) - n_hold)].add(x[rows], [y[rows] for y in labels[1:]])
        if progress is not None:
            progress(i + 1)
    return folds[0], folds[1], start_x, start_id


def _choose_sources(train: _Stats, held: _Stats, layers: range, ds: int, lambdas: Sequence[float], targets: int
                    ) -> tuple[list[int], torch.Tensor]:
    """Step 4: source layers added greedily (up to `MAX_SOURCES`) while the held-out R² averaged
    over the `targets` target layers gains `MIN_GAIN`; returns them ascending, and their held-out
    R² [len(lambdas), targets] (-inf throughout when there was no candidate)."""
    chosen: list[int] = []
    best = torch.full((len(lambdas), targets), -float("inf"), dtype=torch.float64)
    while len(chosen) < min(MAX_SOURCES, len(layers)):
        sets = tqdm([s for s in layers if s not in chosen], desc=f"source layer {len(chosen) + 1}", unit="candidate",
                    leave=False)
        tried = {s: _scores(train, held, _columns(sorted([*chosen, s]), ds), lambdas) for s in sets}
        s, sc = max(tried.items(), key=lambda kv: float(kv[1].max(0).values.mean()))
        if chosen and float(sc.max(0).values.mean()) < float(best.max(0).values.mean()) + MIN_GAIN:
            break
        chosen.append(s)
        best = sc
    return sorted(chosen), best


def _choose_rank(train: _Stats, held: _Stats, cols: torch.Tensor, lam_of: Sequence[float], full: torch.Tensor,
                 ranks: Sequence[int]) -> tuple[int | None, dict[str, float]]:
    """Step 5: the smallest shared bottleneck of `ranks` that keeps every target layer's held-out R²
    within `MAX_RANK_LOSS` of full rank's (`full` [Lt-1]; None: none does, full rank), fit on the
    training fold; and the mean held-out R² per rank tried."""
    g, c = _sub(train, cols)
    hg, hc = _sub(held, cols)
    rank = None
    by_rank = {"full": round(float(full.mean()), 4)}
    w = _maps(g, c, train.n, lam_of)  # [k+1, Lt-1, Dt]
    tried_ranks = [q for q in ranks if q < min(len(cols) - 1, w.shape[1] * w.shape[2])]  # below k and out = (Lt-1) * Dt
    dirs = _directions(w, g, train.n) if tried_ranks else None  # once for every rank tried
    for r in tried_ranks:
        scored = _r2(_reduced(w, g, train.n, r, dirs)[0], hg, hc, held)  # [Lt-1]
        by_rank[str(r)] = round(float(scored.mean()), 4)
        if bool((scored >= full - MAX_RANK_LOSS).all()):
            rank = r
            break
    return rank, by_rank


def profile_translated(source: ModelAdapter, target: ModelAdapter, train_contexts: Sequence[str],
                       test_rows: Sequence[dict[str, Any]], spec: TaskSpec, translator_path: Path,
                       weights: tuple[str, str] = ("", ""), candidates: int = CANDIDATES) -> dict[str, Any]:
    """`droidmesh profile --translate`: fit on `train_contexts` (progress bar), save the
    translator at `translator_path`, score it on `test_rows` (`tasks.translated`)."""
    t0 = time.perf_counter()
    with tqdm(total=len(train_contexts), desc="fit translator", unit="context") as bar:
        translator = fit(source, target, train_contexts, progress=lambda n: bar.update(n - bar.n), weights=weights,
                         candidates=candidates)
    fit_s = round(time.perf_counter() - t0, 2)
    translator_path.parent.mkdir(parents=True, exist_ok=True)
    sha = translator.save(translator_path)
    result = evaluate_translated(source, target, translator, test_rows, spec)
    result.update(translator_file=translator_path.name, translator_sha256=sha, fit_s=fit_s,
                  translator_bytes=translator_path.stat().st_size)
    return result
