"""Per-layer codecs for a chosen plan: which reused layers can travel as int4, which need int8.

One codec for every layer trades too much: int8 keeps a real pair's answers at half of bf16's
bytes, int4 saves a quarter more and loses answers (`docs/real-tier.md`). The layered codec
(`codecs.LayeredCodec`) sends each layer under its own codec in one pull, so a plan can send the
layers its receiver barely reads at 4 bits and the rest at 8. The choice, on train rows only:

  1. `sensitivities`: per reused layer l, the divergence (KL of the receiver's next-token
     distributions from its own full prefill's over its own answer, nats per token:
     `PairScorer.divergences`) of the plan with every reused layer int8 but l int4, less that of
     every reused layer int8: what sending l at 4 bits costs, read where it lands;
  2. `ladder`: the least sensitive share of the reused layers int4 (a quarter, a half, three
     quarters, all), the rest int8; recomputed layers are "raw" (their only item is a group
     start's E, which the recompute starts from);
  3. `choose`: the rung of fewest bytes whose divergence is within `slack` of the plan's own
     (sent raw); all int8 when no rung is; raw when not even all int8 is.

The task metric's verdict on held-out rows (with its interval) is the caller's: `droidmesh bench
layered` and the profile's transfer search score the choice like any other wire.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.tasks.scorer import RAW, Wire
from droidmesh.shared.transport import codecs

Divergence = Callable[[ReusePlan, Wire], Sequence[float]]  # per probe row, nats per answer token
SHARES = (0.25, 0.5, 0.75, 1.0)  # of the reused layers, the least sensitive first, sent int4


def wire_for(plan: ReusePlan, num_layers: int, int4: Sequence[int]) -> Wire:
    """The layered wire of `plan`: reused layers int8, those in `int4` int4, recomputed ones raw."""
    reused = set(plan.reused_layers(num_layers))
    if set(int4) - reused:
        raise ValueError(f"layers {sorted(set(int4) - reused)} are not reused under {plan.label()}")
    names = ["raw" if layer not in reused else "int4" if layer in int4 else "int8" for layer in range(num_layers)]
    return Wire.of(codecs.LAYERED.name, codecs.layers_param(names))


def sensitivities(divergence: Divergence, plan: ReusePlan, num_layers: int) -> tuple[float, dict[int, float]]:
    """(the plan's mean divergence with every reused layer int8, {reused layer: the mean
    divergence it adds sent int4 instead}); one divergence pass per reused layer."""
    base = statistics.fmean(divergence(plan, wire_for(plan, num_layers, [])))
    return base, {layer: statistics.fmean(divergence(plan, wire_for(plan, num_layers, [layer]))) - base
                  for layer in plan.reused_layers(num_layers)}


@dataclasses.dataclass(frozen=True)
class Rung:
    int4: tuple[int, ...]  # reused layers sent int4 (the rest int8), ascending
    wire: Wire


def ladder(plan: ReusePlan, num_layers: int, added: dict[int, float], shares: Sequence[float] = SHARES) -> list[Rung]:
    """Per share, the least sensitive reused layers int4 (ties: the lower layer), fewest first;
    shares that round to the same count give one rung."""
    order = sorted(added, key=lambda layer: (added[layer], layer))
    counts = sorted({max(1, round(s * len(order))) for s in shares}) if order else []
    return [Rung(tuple(sorted(order[:k])), wire_for(plan, num_layers, order[:k])) for k in counts]


@dataclasses.dataclass(frozen=True)
class Choice:
    wire: Wire
    int4: tuple[int, ...]
    why: str


def choose(divergence: Divergence, plan: ReusePlan, num_layers: int, slack: float = 0.1,
           shares: Sequence[float] = SHARES) -> tuple[Choice, dict[str, Any]]:
    """The layered wire for `plan` (module docstring) and the JSON section that shows why:
    `slack` is the share of the plan's own divergence (sent raw) a codec may add to it."""
    if not 0 <= slack < 10:
        raise ValueError(f"slack {slack} outside [0, 10)")
    raw = statistics.fmean(divergence(plan, RAW))
    bound = raw * (1 + slack)
    int8, added = sensitivities(divergence, plan, num_layers)
    rungs = ladder(plan, num_layers, added, shares)
    seen: dict[str, float] = {}  # the rungs' mean divergences, by name
    choice = Choice(RAW, (), f"every reused layer int8 adds more than {slack:.0%} to the plan's raw divergence")
    if int8 <= bound:
        choice = Choice(wire_for(plan, num_layers, []), (), "no int4 rung is within the slack")
        for rung in rungs:
            seen[_name(rung)] = d = statistics.fmean(divergence(plan, rung.wire))
            if d > bound:
                break  # a rung holds the one below it plus more layers: past the bound, stay below
            choice = Choice(rung.wire, rung.int4, f"the most int4 layers within {slack:.0%} of the raw divergence")
    section = {"plan": plan.to_dict(), "slack": slack, "bound_nats": bound, "raw_nats": raw, "int8_nats": int8,
               "added_by_int4_nats": {str(layer): v for layer, v in added.items()},
               "rungs": {_name(r): {"int4": list(r.int4), "nats": seen.get(_name(r))} for r in rungs},
               "chosen": {"int4": list(choice.int4), "codec": choice.wire.codec, "codec_params": dict(choice.wire.params),
                          "why": choice.why}}
    return choice, section


def _name(rung: Rung) -> str:
    return f"int4 x{len(rung.int4)}"
