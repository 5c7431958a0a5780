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
     (sent raw); all int8 when no rung is; raw when not even all int8 is;
  4. thinner, each kept only while the divergence stays within the same bound: the group start's
     E int8 instead of raw (E is ~0.05 of every layer's bf16 K/V on a 30-layer model: 0.44 of it
     saved), then the int4 layers at a coarser group (`coarse_group`, 64 where it divides the head
     dim: 5 bits a value instead of 6, the group's float32 scale and minimum shared by twice the
     values).

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


def wire_for(plan: ReusePlan, num_layers: int, int4: Sequence[int], group: int | None = None,
             e_codec: str = "raw") -> Wire:
    """The layered wire of `plan`: reused layers int8, those in `int4` int4 (in groups of `group`
    values, int4's default when None), recomputed ones `e_codec` (raw or int8: their only item is
    a group start's E)."""
    reused = set(plan.reused_layers(num_layers))
    if set(int4) - reused:
        raise ValueError(f"layers {sorted(set(int4) - reused)} are not reused under {plan.label()}")
    if e_codec not in ("raw", "int8"):
        raise ValueError(f"E travels raw or int8, not {e_codec!r}")
    names = [e_codec if layer not in reused else "int4" if layer in int4 else "int8" for layer in range(num_layers)]
    params = codecs.layers_param(names) | ({codecs.GROUP_PARAM: group} if group is not None else {})
    return Wire.of(codecs.LAYERED.name, params)


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
    group: int | None = None  # the int4 layers' group; None: int4's default
    e_codec: str = "raw"  # the group start's E

    def wire_of(self, plan: ReusePlan, num_layers: int) -> Wire:
        return wire_for(plan, num_layers, self.int4, self.group, self.e_codec)


THINNER = ("E int8", "coarse group")  # step 4, in order
COARSE_GROUP = 64  # twice int4's default group of 32


def coarse_group(head_dim: int) -> int | None:
    """The coarser int4 group step 4 tries for K / V of `head_dim`, None where it does not divide it."""
    return COARSE_GROUP if head_dim % COARSE_GROUP == 0 else None


WIRES = ("int8", "int4", f"int4-g{COARSE_GROUP}-e-int8")  # every reused layer alike: `named_wire`


def named_wire(name: str, plan: ReusePlan, num_layers: int, head_dim: int) -> Wire:
    """One codec for every layer `plan` reuses, by name (`WIRES`): int8; int4 (groups of 32); or
    int4 in groups of 64 with the group start's E int8, the fewest bytes the per-layer choice
    reaches (`droidmesh bench layered`). A group start's E travels raw otherwise."""
    every = list(plan.reused_layers(num_layers))
    if name == "int8":
        return wire_for(plan, num_layers, [])
    if name == "int4":
        return wire_for(plan, num_layers, every)
    if name == WIRES[2]:
        group = coarse_group(head_dim)
        if group is None:
            raise ValueError(f"{name}: int4 in groups of {COARSE_GROUP} needs a head dim it divides, not {head_dim}")
        return wire_for(plan, num_layers, every, group, "int8")
    raise ValueError(f"unknown wire {name!r}; expected one of {list(WIRES)}")


def choose(divergence: Divergence, plan: ReusePlan, num_layers: int, slack: float = 0.1,
           shares: Sequence[float] = SHARES, coarse_group: int | None = None) -> tuple[Choice, dict[str, Any]]:
    """The layered wire for `plan` (module docstring) and the JSON section that shows why:
    `slack` is the share of the plan's own divergence (sent raw) a codec may add to it;
    `coarse_group` (None: no such step) an int4 group that divides the head dim."""
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
    thinner: dict[str, float] = {}
    if choice.wire != RAW:
        choice, thinner = _thin(divergence, plan, num_layers, choice, bound, coarse_group)
    section = {"plan": plan.to_dict(), "slack": slack, "bound_nats": bound, "raw_nats": raw, "int8_nats": int8,
               "added_by_int4_nats": {str(layer): v for layer, v in added.items()},
               "rungs": {_name(r): {"int4": list(r.int4), "nats": seen.get(_name(r))} for r in rungs},
               "thinner_nats": thinner,
               "chosen": {"int4": list(choice.int4), "group": choice.group, "e_codec": choice.e_codec,
                          "codec": choice.wire.codec, "codec_params": dict(choice.wire.params), "why": choice.why}}
    return choice, section


def _thin(divergence: Divergence, plan: ReusePlan, num_layers: int, choice: Choice, bound: float,
          coarse_group: int | None) -> tuple[Choice, dict[str, float]]:
    """Step 4: `THINNER` in order on `choice`, each kept when its divergence is within `bound`;
    {step: its mean divergence} for the steps scored."""
    scored: dict[str, float] = {}
    for name in THINNER:
        if name == "E int8" and plan.e_layers:
            tried = dataclasses.replace(choice, e_codec="int8")
        elif choice.int4 and coarse_group is not None:
            tried = dataclasses.replace(choice, group=coarse_group)
        else:
            continue
        tried = dataclasses.replace(tried, wire=tried.wire_of(plan, num_layers), why=f"{choice.why}; {name}")
        scored[name] = d = statistics.fmean(divergence(plan, tried.wire))
        if d <= bound:
            choice = tried
    return choice, scored


def _name(rung: Rung) -> str:
    return f"int4 x{len(rung.int4)}"
