"""The transfer search on a fake scorer: candidates, bytes, the rule, and the choice per link rate."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv import policy, quant, scd
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.mesh.config_board import validate
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling import layer_codecs, scd_fit, transfer
from droidmesh.shared.profiling.profile import ProfileSettings, recompute_config, run
from droidmesh.shared.tasks.scorer import Wire
from droidmesh.shared.transport import codecs
from droidmesh.shared.wire.schemas import LatencyFit

L, H, D, RANK = 4, 4, 32, 2  # layers, kv heads, head_dim = hidden, the maps' true rank
LAYOUT = transfer.Layout(num_layers=L, kv_heads=H, head_dim=D, hidden=D, dtype=torch.float32)
RAW_BYTES = (2 * 2 * H * D + D) * 4  # per token: K and V of reused layers 0 and 3, E at 1
GROUP = ReusePlan.recompute(1, 3)
FIT = LatencyFit(c0=0.0, c_tok=0.0, c_layer_tok=1e-6, c_attn=0.0, kv_bytes_per_token_layer=2 * H * D * 4,
                 e_bytes_per_token=D * 4)  # 1 ms per 1K tokens per recomputed layer
NAMES = ["raw [1,3)", "int8 [1,3)", "int4 [1,3)", "lowrank s0.8 [1,3)", "lowrank s0.9 [1,3)", "lowrank s0.95 [1,3)",
         "lowrank s0.99 [1,3)", "lowrank s0.95 patch 1,2 p0.99", "lowrank s0.95 patch 1,2 p0.999",
         "lowrank s0.95 patch 1 p0.999 [2,3)"]


def pair_fits() -> scd_fit.PairFits:
    """Every item's map has rank RANK (y = x @ A), so no share keeps more than RANK codes."""
    g = torch.Generator().manual_seed(0)
    fits = {}
    for l in range(L):
        for kind in ("K", "V", "E"):
            h = 1 if kind == "E" else H
            a = torch.randn(h, D, RANK, generator=g) @ torch.randn(h, RANK, D, generator=g)
            x = torch.randn(h, 64, D, generator=g)
            m = scd.Moments()
            m.add(x, x @ a)
            fits[(l, kind)] = m.fit()
    rope = scd.Rope(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 1.0)
    return scd_fit.PairFits(fits, rope, L, 64, 0.5, {})


def quality(plan: ReusePlan, wire: Wire) -> float:
    """Raw 1.0, int8 0.99, int4 0.90 (fails a 5% rule); lowrank 0.97 from share 0.95 up, else 0.80;
    patching every group layer 0.50 (fails), patching the first and recomputing the rest 0.96."""
    if wire.codec != "lowrank":
        return {"raw": 1.0, "int8": 0.99, "int4": 0.90, "layered": 0.98}[wire.codec]
    if plan.patch:
        return 0.96 if plan.groups else 0.50
    share = float(codecs.LOWRANK.maps(dict(wire.params)[codecs.MAPS_PARAM]).meta["share"])
    return 0.97 if share >= 0.95 else 0.80


@pytest.fixture(scope="module")
def searched() -> tuple[dict, dict[str, bytes]]:
    return transfer.search(quality, quality, pair_fits(), LAYOUT, GROUP, 1.0, 0.05, FIT)


def test_every_candidate_is_scored_with_its_bytes_and_the_rule(searched):
    """The ten configs, each with exact bytes (lowrank: RANK codes per K / V, raw E at a group
    start; as `scd_fit.wire_bytes_per_token` counts them), train / test quality and the rule."""
    section, files = searched
    rows = {c["name"]: c for c in section["configs"]}
    assert list(rows) == NAMES
    assert rows["raw [1,3)"]["wire_bytes_per_token"] == rows["raw [1,3)"]["raw_bytes_per_token"] == RAW_BYTES
    low = rows["lowrank s0.95 [1,3)"]
    assert list(low["ranks"]) == ["0.K", "0.V", "3.K", "3.V"] and all(1 <= r <= RANK for r in low["ranks"].values())
    assert low["wire_bytes_per_token"] == (H * sum(low["ranks"].values()) + D) * 4  # codes, and E at 1 raw
    assert low["bytes_ratio"] == low["wire_bytes_per_token"] / RAW_BYTES
    maps = codecs.LOWRANK.maps(low["maps_sha256"])
    assert low["wire_bytes_per_token"] == scd_fit.wire_bytes_per_token(maps, GROUP, L, H, D, D, 4)
    assert low["maps_file"] == f"maps/{low['maps_sha256']}.safetensors" and low["maps_sha256"] in files
    assert scd.Maps.from_bytes(files[low["maps_sha256"]], low["maps_sha256"]).ranks() == low["ranks"]
    assert {n for n, c in rows.items() if not c["meets_rule"]} == {
        "int4 [1,3)", "lowrank s0.8 [1,3)", "lowrank s0.9 [1,3)", "lowrank s0.95 patch 1,2 p0.99",
        "lowrank s0.95 patch 1,2 p0.999"}
    assert rows["lowrank s0.95 patch 1 p0.999 [2,3)"]["plan"] == {"mode": "groups", "groups": [[2, 3]], "ratio": 0.0,
                                                                   "patch": [1]}


def test_the_choice_per_link_is_the_fastest_config_meeting_the_rule(searched):
    """Slow links pick the fewest bytes (lowrank), fast ones the least compute (patch the first
    layer, recompute one); every choice is the predicted-fastest config that meets the rule."""
    section, _ = searched
    rows = {c["name"]: c for c in section["configs"]}
    chosen = section["chosen_by_link"]
    assert chosen["0.1"]["4096"] == "lowrank s0.95 [1,3)"
    assert chosen["2"]["4096"] == "lowrank s0.95 patch 1 p0.999 [2,3)"
    for rate, per in chosen.items():
        for tokens, name in per.items():
            ttft = {n: c["predicted_ttft_s"][tokens][rate] for n, c in rows.items()}
            assert rows[name]["meets_rule"] and ttft[name] == min(t for n, t in ttft.items() if rows[n]["meets_rule"])
    raw = rows["raw [1,3)"]["predicted_ttft_s"]["4096"]["0.1"]
    assert raw == pytest.approx(4096 * RAW_BYTES * 8 / 0.1e9)  # link-bound: bytes / rate


def test_published_config_offers_the_coded_configs_meeting_the_rule(searched):
    """`recompute_config` adds each non-raw config meeting the rule as a frontier point (codec,
    maps, patch layers, wire bytes) that validates, and a slow link selects a coded one."""
    section, _ = searched
    result = run(quality_of_plan, quality_of_plan, L, ProfileSettings(granularity=1), pair=Pair("s", "r", "t"))
    result["transfer"] = section
    cfg = validate(recompute_config(result, ModelRef("s", "s", "ci", "a" * 64), ModelRef("r", "r", "ci", "b" * 64), 1))
    coded = [p for p in cfg.frontier if p.plan.codec != "raw"]
    assert len(coded) == 4 and len(cfg.frontier) == len(result["frontier"]) + 4
    patched = next(p for p in coded if p.plan.patch_layers)
    assert (patched.plan.groups, patched.plan.patch_layers, patched.recomputed_layers) == ([(2, 3)], [1], 1)
    assert all(p.wire_bytes_per_token > 0 for p in coded)
    cfg.latency = FIT
    assert policy.select_point(cfg, queued=1, tokens=4096, bandwidth_bps=0.1e9 / 8).plan.codec == "lowrank"


def quality_of_plan(plan: ReusePlan) -> float:
    """The group search's oracle: layers 1 and 2 must be recomputed."""
    return 1.0 if plan.mode == "full_prefill" or {1, 2} <= set(plan.recomputed_layers(L)) else 0.5


def test_candidates_for_several_groups_and_for_full_reuse():
    """Patching the first layer of [2,3),[4,6) recomputes [4,6); full reuse gets no patch configs."""
    names = [c.name for c in transfer.candidates(ReusePlan.recompute_groups([(2, 3), (4, 6)]), 8, transfer.Settings())]
    assert names[-1] == "lowrank s0.95 patch 2 p0.999 [4,6)" and names[-2] == "lowrank s0.95 patch 2,4,5 p0.999"
    assert [c.name for c in transfer.candidates(ReusePlan.full_reuse(), 8, transfer.Settings())][:2] == [
        "raw full reuse", "int8 full reuse"]
    assert all(not c.plan.patch for c in transfer.candidates(ReusePlan.full_reuse(), 8, transfer.Settings()))


def test_a_layered_candidate_is_scored_with_its_exact_bytes_and_published_as_it_was_scored():
    """The per-layer codec's candidate (layer 0 int4, layer 3 int8, the group start's E raw) is
    scored under its own wire, its bytes are each layer's codec's, and the config a receiver gets
    names the same codec per layer; a string that does not name every layer is refused."""
    wire = layer_codecs.wire_for(GROUP, L, [0])
    extra = transfer.Candidate("layered int4 x1 [1,3)", GROUP, wire.codec, params=wire.params)
    seen: list[Wire] = []

    def score(plan: ReusePlan, w: Wire) -> float:
        seen.append(w)
        return quality(plan, w)

    section, _ = transfer.search(score, score, pair_fits(), LAYOUT, GROUP, 1.0, 0.05, FIT, more=[extra])
    row = section["configs"][-1]
    assert row["name"] == "layered int4 x1 [1,3)" and row["codec_params"] == {"layers": "4rr8"} and seen[-1] == wire
    kv = (1, H, 4096, D)
    exact = 2 * quant.int4_nbytes(kv, 32) + quant.int8_nbytes(kv, "K") + quant.int8_nbytes(kv, "V") + 4096 * D * 4
    assert row["wire_bytes_per_token"] == -(-exact // 4096)  # layer 0 int4, layer 3 int8, E at 1 raw
    assert row["meets_rule"]
    result = run(quality_of_plan, quality_of_plan, L, ProfileSettings(granularity=1), pair=Pair("s", "r", "t"))
    result["transfer"] = section
    refs = ModelRef("s", "s", "ci", "a" * 64), ModelRef("r", "r", "ci", "b" * 64)
    cfg = validate(recompute_config(result, *refs, 1))
    (layered,) = [p for p in cfg.frontier if p.plan.codec == "layered"]
    assert layered.plan.codec_params == {"layers": "4rr8"} and layered.plan.groups == [(1, 3)]
    row["codec_params"] = {"layers": "4rr"}
    with pytest.raises(BadRequestError, match="3 layers' codecs for a model of 4 layers"):
        validate(recompute_config(result, *refs, 1))
    for group in ("64", 0, True, 4096):  # a sender would refuse each at every pull
        row["codec_params"] = {"layers": "4rr8", "group": group}
        with pytest.raises(BadRequestError, match="int4 group .*: a whole number of values in"):
            validate(recompute_config(result, *refs, 1))
    row["codec_params"] = {"layers": "4rr8", "group": 64}
    assert validate(recompute_config(result, *refs, 1))
