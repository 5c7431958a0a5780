"""The per-layer codec choice (shared/profiling/layer_codecs.py) on constructed divergences: a
fake pass whose divergence is the plan's own plus what each layer's codec adds."""

from __future__ import annotations

import pytest

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.profiling import layer_codecs
from droidmesh.shared.tasks.scorer import RAW, Wire

PLAN = ReusePlan.recompute(2, 4)  # 8 layers: 0, 1, 4, 5, 6, 7 reused
INT8 = 0.005  # nats each int8 layer adds


def fake(int4_cost: dict[int, float], own: float = 1.0, calls: list | None = None):
    def divergence(plan: ReusePlan, wire: Wire) -> list[float]:
        assert plan == PLAN
        if calls is not None:
            calls.append(wire)
        if wire == RAW:
            return [own, own]
        layers = dict(wire.params)["layers"]
        extra = sum(INT8 if c == "8" else int4_cost[i] if c == "4" else 0.0 for i, c in enumerate(layers))
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
    assert choice.int4 == (0, 6, 7) and dict(choice.wire.params) == {"layers": "48rr8844"}
    assert section["chosen"]["int4"] == [0, 6, 7] and section["bound_nats"] == pytest.approx(1.1)
    assert section["added_by_int4_nats"]["5"] == pytest.approx(0.9 - INT8)
    assert list(section["rungs"]) == ["int4 x2", "int4 x3", "int4 x4", "int4 x6"]
    assert section["rungs"]["int4 x6"]["nats"] is None  # never scored: the one below it failed
    # raw, all int8, one per reused layer, then the rungs up to the first past the bound
    assert len(calls) == 1 + 1 + 6 + 3


def test_every_layer_int4_when_all_fit():
    choice, _ = layer_codecs.choose(fake({i: 0.001 for i in (0, 1, 4, 5, 6, 7)}), PLAN, 8, slack=0.1)
    assert choice.int4 == (0, 1, 4, 5, 6, 7) and dict(choice.wire.params) == {"layers": "44rr4444"}


def test_int8_when_no_rung_fits_and_raw_when_int8_does_not():
    tight = {i: 0.5 for i in (0, 1, 4, 5, 6, 7)}
    choice, section = layer_codecs.choose(fake(tight), PLAN, 8, slack=0.1)
    assert choice.int4 == () and dict(choice.wire.params) == {"layers": "88rr8888"}
    assert section["chosen"]["why"] == "no int4 rung is within the slack"
    choice, section = layer_codecs.choose(fake(tight), PLAN, 8, slack=0.01)  # 6 int8 layers add 0.03 > 0.01
    assert choice.wire == RAW and "int8 adds more than 1%" in section["chosen"]["why"]


def test_full_reuse_and_a_bad_slack():
    plan = ReusePlan.full_reuse()
    calls: list[Wire] = []

    def divergence(p, wire):
        calls.append(wire)
        return [0.1]

    choice, _ = layer_codecs.choose(divergence, plan, 4, slack=0.5)
    assert dict(choice.wire.params) == {"layers": "4444"}
    with pytest.raises(ValueError, match="slack"):
        layer_codecs.choose(divergence, plan, 4, slack=-1)
