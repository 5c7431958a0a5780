"""`droidmesh bench screen`: the receiver's KV screen (`shared/kv/screen.py`) on real pairs — its
false positives on honest pulls and its catch rate per attack.

Per pair (a sender model, a receiver model, the plan the receiver would pull under) and per
context (real text the pairs never trained on: the real tier's test splits): the sender's
capturing prefill of the context is what an honest sender serves; the receiver reads it through
`ScreenedSource` exactly as a pull is read (E first, then each reused layer's K/V, the direction
test once the last arrived), with the receiver's own screen (`Screen.of_model`). An honest
request that fails is a false positive. Then each attack replaces what the sender serves:
  flip_*        the sign of every K / V / E, of one kind only, or of K and V in the first n reused layers
  other_context another context's honest cache of the same length (another request's)
  zeros, noise  all zeros; Gaussian noise at each tensor's own rms (no offset)
  plus_noise    honest values plus noise of their own rms (half the signal's power is noise)
  scaled        honest values times 20
and the share caught (the request refused) is its catch rate, with a 95 % Wilson interval.
The cost is the screen's own time per request (its reads, on the receiver's device).

In process, no mesh: the screen judges tensors, not transports (the system tests show pulls
going through it: tests/system/test_garbage_kv.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.screen import Screen, ScreenedSource
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.tasks.intervals import wilson

DEADLINE_S = 60.0
FLIP_LAYERS = (1, 2, 4)
Attack = Callable[[CapturedContext, CapturedContext, Sequence[int], torch.Generator], CapturedContext]


def _map(cap: CapturedContext, k: Callable[[int, torch.Tensor], torch.Tensor],
         v: Callable[[int, torch.Tensor], torch.Tensor], e: Callable[[int, torch.Tensor], torch.Tensor]
         ) -> CapturedContext:
    """`cap` with each layer's K, V and E replaced by k(layer, K), v(layer, V), e(layer, E)."""
    kv = tuple(KVBlock(l, k(l, b.k), v(l, b.v)) for l, b in enumerate(cap.kv))
    return dataclasses.replace(cap, kv=kv, e={l: e(l, t) for l, t in cap.e.items()})


def _same(_: int, t: torch.Tensor) -> torch.Tensor:
    return t


def _flip(_: int, t: torch.Tensor) -> torch.Tensor:
    return -t


def _noise_like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Offset-free Gaussian noise with `t`'s rms, in its dtype and on its device (drawn on the CPU:
    one generator, the same draws on any device)."""
    rms = t.float().pow(2).mean().sqrt().cpu()
    return (torch.randn(t.shape, generator=g) * rms).to(device=t.device, dtype=t.dtype)


def attacks() -> dict[str, Attack]:
    """Name -> what a hostile sender serves instead of the honest capture (`honest`, `other`: another
    context's capture of the same length, `reused`: the plan's reused layers in order)."""
    out: dict[str, Attack] = {
        "flip_all": lambda h, o, r, g: _map(h, _flip, _flip, _flip),
        "flip_K": lambda h, o, r, g: _map(h, _flip, _same, _same),
        "flip_V": lambda h, o, r, g: _map(h, _same, _flip, _same),
        "flip_E": lambda h, o, r, g: _map(h, _same, _same, _flip),
        "other_context": lambda h, o, r, g: dataclasses.replace(o, token_ids=h.token_ids),
        "zeros": lambda h, o, r, g: _map(h, *(3 * (lambda l, t: torch.zeros_like(t),))),
        "noise": lambda h, o, r, g: _map(h, *(3 * (lambda l, t: _noise_like(t, g),))),
        "plus_noise": lambda h, o, r, g: _map(h, *(3 * (lambda l, t: t + _noise_like(t, g),))),
        "scaled": lambda h, o, r, g: _map(h, *(3 * (lambda l, t: t * 20,))),
    }
    for n in FLIP_LAYERS:
        def first(h: CapturedContext, o: CapturedContext, r: Sequence[int], g: torch.Generator,
                  n: int = n) -> CapturedContext:
            chosen = set(r[:n])
            some = lambda l, t: -t if l in chosen else t  # noqa: E731
            return _map(h, some, some, _same)
        out[f"flip_KV_{n}_layers"] = first
    return out


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    sender: ModelAdapter
    receiver: ModelAdapter
    plan: ReusePlan


def judge(screen: Screen, receiver: ModelAdapter, plan: ReusePlan, served: CapturedContext) -> tuple[str | None, float]:
    """(None if the screen passes `served` as a pull under `plan`, else its reason; seconds the
    screen's reads took), reading as the engine does: E first, then each reused layer's K/V."""
    reused = plan.reused_layers(receiver.num_layers)
    tokens = len(served.token_ids)
    expected = [("E", l) for l in plan.e_layers] + [("K", l) for l in reused]
    src = ScreenedSource(CapturedSource(served), screen, receiver, expected=expected,
                         starts=plan.window_starts(receiver.windows, tokens))
    deadline = time.monotonic() + DEADLINE_S
    sync = torch.cuda.synchronize if receiver.device.type == "cuda" else (lambda: None)
    sync()
    began = time.perf_counter()
    try:
        for l in plan.e_layers:
            src.e(l, deadline)
        for l in reused:
            src.kv(l, deadline)
    except IntegrityError as e:
        return str(e), time.perf_counter() - began
    sync()  # the screen's reads end in a device-to-host read; what is queued behind it counts too
    return None, time.perf_counter() - began


def contexts(tokenizer: Any, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`n` contexts of exactly `tokens` tokens (the mesh's own tokenization, `text.context_ids`):
    the real tier's test rows (docstrings, manual pages, library source: split by source, never
    trained on) in turn, each cut to its first `tokens`; rows shorter than that are skipped."""
    from droidmesh.shared.model import text
    from droidmesh.shared.tasks.realtext import REAL_TASKS, make_real_rows

    per_task = -(-n // len(REAL_TASKS))
    rows = [make_real_rows(task, "test", 2 * per_task, chars=(4 * tokens, 6 * tokens), seed=seed)
            for task in REAL_TASKS]
    out: list[list[int]] = []
    for i in range(2 * per_task):
        for task_rows in rows:
            if i < len(task_rows) and len(out) < n:
                ids = text.context_ids(tokenizer, task_rows[i]["context"])
                if len(ids) >= tokens:
                    out.append(ids[:tokens])
    if len(out) < n:
        raise ValueError(f"only {len(out)} test contexts of {tokens} tokens; ask fewer or shorter")
    return out


class _PairRun:
    """One pair's tally: honest pulls, and attacks on every `attack_every`-th context."""

    def __init__(self, pair: Pair, seed: int, attack_every: int):
        screen = Screen.of_model(pair.receiver)
        if screen is None:
            raise ValueError(f"{pair.receiver.name} has no tokenizer: no screen")
        self.pair, self.screen, self.attack_every = pair, screen, attack_every
        self.g = torch.Generator().manual_seed(seed)
        self.reused = pair.plan.reused_layers(pair.receiver.num_layers)
        self.kinds = {k: a for k, a in attacks().items() if pair.plan.e_layers or k != "flip_E"}
        self.trials: dict[str, int] = dict.fromkeys(self.kinds, 0)
        self.caught: dict[str, int] = dict.fromkeys(self.kinds, 0)
        self.honest: list[dict[str, Any]] = []

    def add(self, i: int, cap: CapturedContext, previous: CapturedContext | None) -> None:
        pair = self.pair
        why, seconds = judge(self.screen, pair.receiver, pair.plan, cap)
        self.honest.append({"tokens": len(cap.token_ids), "refused": why, "screen_s": seconds})
        for name, attack in self.kinds.items() if i % self.attack_every == 0 else ():
            if name == "other_context" and previous is None:
                continue
            refused, _ = judge(self.screen, pair.receiver, pair.plan, attack(cap, previous or cap, self.reused, self.g))
            self.caught[name] += refused is not None
            self.trials[name] += 1

    def summary(self) -> dict[str, Any]:
        return _summary(self.pair, self.honest, self.caught, self.trials)


def run_pairs(pairs: Sequence[Pair], contexts: Sequence[list[int]], seed: int = 0, attack_every: int = 1,
              progress: bool = True) -> list[dict[str, Any]]:
    """Pairs of one sender (the same weights): each context captured once, with the E every plan
    pulls, and judged by each pair's receiver under its plan (`run_pair` each)."""
    sender = pairs[0].sender
    if any(p.sender is not sender for p in pairs):
        raise ValueError("run_pairs takes pairs of one sender model")
    runs = [_PairRun(p, seed, attack_every) for p in pairs]
    e_layers = sorted({l for p in pairs for l in p.plan.e_layers})
    previous: CapturedContext | None = None
    for i, ids in enumerate(tqdm(contexts, desc=", ".join(p.name for p in pairs), disable=not progress)):
        cap = capture_prefill(sender, ids, e_layers=e_layers)
        for run in runs:
            run.add(i, cap, previous)
        previous = cap
    return [run.summary() for run in runs]


def run_pair(pair: Pair, contexts: Sequence[list[int]], seed: int = 0, attack_every: int = 1,
             progress: bool = True) -> dict[str, Any]:
    """An honest pull of every context, and each attack on every `attack_every`-th (the previous
    context's capture is the `other_context` attack's: contexts are of one length, `contexts`).
    An attack on what the plan does not pull (E under full reuse) is left out."""
    return run_pairs([pair], contexts, seed, attack_every, progress)[0]


def _summary(pair: Pair, honest: list[dict[str, Any]], caught: dict[str, int], trials: dict[str, int]
             ) -> dict[str, Any]:
    fp = sum(h["refused"] is not None for h in honest)
    times = sorted(h["screen_s"] for h in honest)
    rows = []
    for name, k in caught.items():
        n = trials[name]
        lo, hi = wilson(k, n)
        rows.append({"attack": name, "trials": n, "caught": k, "rate": k / n if n else None,
                     "ci95": [round(lo, 4), round(hi, 4)]})
    lo, hi = (round(x, 4) for x in wilson(fp, len(honest)))
    return {"pair": pair.name, "plan": pair.plan.label(), "honest_pulls": len(honest), "false_positives": fp,
            "false_positive_ci95": [lo, hi], "refusals": [h["refused"] for h in honest if h["refused"]][:5],
            "screen_ms_p50": 1000 * times[len(times) // 2] if times else None,
            "screen_ms_p90": 1000 * times[int(len(times) * 0.9)] if times else None,
            "tokens_median": sorted(h["tokens"] for h in honest)[len(honest) // 2] if honest else None,
            "attacks": rows}


def table_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (pair, attack), the honest row first."""
    out = []
    for r in results:
        lo, hi = r["false_positive_ci95"]
        out.append({"pair": r["pair"], "plan": r["plan"], "pulls": "honest", "trials": r["honest_pulls"],
                    "refused": r["false_positives"], "rate": r["false_positives"] / max(1, r["honest_pulls"]),
                    "ci95_lo": lo, "ci95_hi": hi, "screen_ms_p50": r["screen_ms_p50"]})
        for a in r["attacks"]:
            out.append({"pair": r["pair"], "plan": r["plan"], "pulls": a["attack"], "trials": a["trials"],
                        "refused": a["caught"], "rate": a["rate"], "ci95_lo": a["ci95"][0], "ci95_hi": a["ci95"][1],
                        "screen_ms_p50": None})
    return out


COLUMNS = ["pair", "plan", "pulls", "trials", "refused", "rate", "ci95_lo", "ci95_hi", "screen_ms_p50"]
