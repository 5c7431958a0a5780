"""The per-layer codec choice (shared/profiling/layer_codecs.py) on constructed divergences: a
fake pass whose divergence is the plan's own plus what each layer's codec adds."""

from __future__ import annotations

import pytest

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import layer_codecs
from droidmesh.shared.tasks.scorer import RAW, Wire

PLAN = ReusePlan.recompute(2, 4)  # 8 layers: 0, 1, 4, 5, 6, 7 reused
INT8 = 0.005  # nats each int8 layer adds


def fake(int4_cost: dict[int, float], own: float = 1.0, calls: list | None = None, e_int8: float = 0.0,
         coarse: float = 0.0):
    """`e_int8`: what the group start's E int8 adds (recomputed layers' letters: only layer 2's
    E travels); `coarse`: what each int4 layer adds more in groups of 64."""
    def divergence(plan: ReusePlan, wire: Wire) -> list[float]:
        assert plan == PLAN
        if calls is not None:
            calls.append(wire)
        if wire == RAW:
            return [own, own]
        params = dict(wire.params)
        g64 = coarse if params.get("group") == 64 else 0.0
        extra = sum((e_int8 if c == "8" and i == 2 else 0.0) if i in (2, 3)
                    else INT8 if c == "8" else int4_cost[i] + g64 if c == "4" else 0.0
                    for i, c in enumerate(params["layers"]))
        return [own + extra - 0.01, own + extra + 0.01]  # two rows around the mean
    return divergence


def test_the_wire_names_a_codec_per_layer():
    wire = layer_codecs.wire_for(PLAN, 8, [5, 0])
    assert wire.codec == "layered" and dict(wire.params) == {"layers": "48rr8488"}
    with pytest.raises(ValueError, match=r"layers \[3\] are not reused"):
        layer_codecs.wire_for(PLAN, 8, [3])


def test_the_least_sensitive_layers_go_int4_up_to_the_slack():
    """Layers 0, 6 and 7 barely matter at 4 bits, 1 and 4 somewhat, 5 a lot: with 10 % slack on a
    plan of 1.0 nats, the rungs add 0.03 (quarter: 2 layers), 0.06 (half: 3) then 0.26 (4 layers,
    past the bound): the half is chosen, the ladder stops there."""
    cost = {0: 0.01, 1: 0.2, 4: 0.2, 5: 0.9, 6: 0.02, 7: 0.02}
    calls: list[Wire] = []
    choice, section = layer_codecs.choose(fake(cost, calls=calls), PLAN, 8, slack=0.1)
    assert choice.int4 == (0, 6, 7) and dict(choice.wire.params) == {"layers": "488888" + "44"}  # E int8 too
    assert section["chosen"]["int4"] == [0, 6, 7] and section["bound_nats"] == pytest.approx(1.1)
    assert section["added_by_int4_nats"]["5"] == pytest.approx(0.9 - INT8)
    assert list(section["rungs"]) == ["int4 x2", "int4 x3", "int4 x4", "int4 x6"]
    assert section["rungs"]["int4 x6"]["nats"] is None  # never scored: the one below it failed
    # raw, all int8, one per reused layer, the rungs up to the first past the bound, E int8 (no
    # coarse group asked for)
    assert len(calls) == 1 + 1 + 6 + 3 + 1
    assert list(section["thinner_nats"]) == ["E int8"]


def test_every_layer_int4_when_all_fit():
    choice, _ = layer_codecs.choose(fake({i: 0.001 for i in (0, 1, 4, 5, 6, 7)}), PLAN, 8, slack=0.1)
    assert choice.int4 == (0, 1, 4, 5, 6, 7) and dict(choice.wire.params) == {"layers": "44884444"}


def test_int8_when_no_rung_fits_and_raw_when_int8_does_not():
    tight = {i: 0.5 for i in (0, 1, 4, 5, 6, 7)}
    choice, section = layer_codecs.choose(fake(tight), PLAN, 8, slack=0.1)
    assert choice.int4 == () and dict(choice.wire.params) == {"layers": "88888888"}
    assert section["chosen"]["why"] == "no int4 rung is within the slack; E int8"
    choice, section = layer_codecs.choose(fake(tight), PLAN, 8, slack=0.01)  # 6 int8 layers add 0.03 > 0.01
    assert choice.wire == RAW and "int8 adds more than 1%" in section["chosen"]["why"]
    assert section["thinner_nats"] == {}  # nothing to thin on a raw wire


def test_full_reuse_and_a_bad_slack():
    plan = ReusePlan.full_reuse()
    calls: list[Wire] = []

    def divergence(p, wire):
        calls.append(wire)
        return [0.1]

    choice, section = layer_codecs.choose(divergence, plan, 4, slack=0.5)
    assert dict(choice.wire.params) == {"layers": "4444"}
    assert section["thinner_nats"] == {}  # no E to send int8, no coarse group asked for
    with pytest.raises(ValueError, match="slack"):
        layer_codecs.choose(divergence, plan, 4, slack=-1)


def test_the_wire_carries_the_group_and_the_e_codec():
    wire = layer_codecs.wire_for(PLAN, 8, [0], group=64, e_codec="int8")
    assert dict(wire.params) == {"layers": "48888888", "group": 64}
    with pytest.raises(ValueError, match="raw or int8"):
        layer_codecs.wire_for(PLAN, 8, [0], e_codec="int4")
    assert layer_codecs.coarse_group(64) == 64 and layer_codecs.coarse_group(128) == 64
    assert layer_codecs.coarse_group(80) is None and layer_codecs.coarse_group(16) is None


def test_thinner_steps_are_kept_only_within_the_bound():
    """Every layer int4 fits (0.006 of a 0.1 slack). E int8 adds 0.03 (within: kept), the coarse
    group 0.02 a layer (6 layers: 0.12 more, past the bound: dropped); with 0.005 a layer both."""
    cheap = {i: 0.001 for i in (0, 1, 4, 5, 6, 7)}
    choice, section = layer_codecs.choose(fake(cheap, e_int8=0.03, coarse=0.02), PLAN, 8, slack=0.1, coarse_group=64)
    assert (choice.e_codec, choice.group) == ("int8", None)
    assert dict(choice.wire.params) == {"layers": "44884444"}
    assert section["thinner_nats"]["E int8"] == pytest.approx(1.0 + 0.006 + 0.03)
    assert section["thinner_nats"]["coarse group"] == pytest.approx(1.0 + 0.006 + 0.03 + 0.12)
    assert section["chosen"]["why"].endswith("; E int8")
    choice, section = layer_codecs.choose(fake(cheap, e_int8=0.03, coarse=0.005), PLAN, 8, slack=0.1, coarse_group=64)
    assert (choice.e_codec, choice.group) == ("int8", 64)
    assert dict(choice.wire.params) == {"layers": "44884444", "group": 64}
    assert section["chosen"]["why"].endswith("; E int8; coarse group") and section["chosen"]["group"] == 64
    # E that does not fit stays raw, and the coarse group is still tried on the raw-E wire
    choice, section = layer_codecs.choose(fake(cheap, e_int8=0.2, coarse=0.005), PLAN, 8, slack=0.1, coarse_group=64)
    assert (choice.e_codec, choice.group) == ("raw", 64)
    assert dict(choice.wire.params) == {"layers": "44rr4444", "group": 64}
