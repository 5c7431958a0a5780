"""`bench hosts`: the modelled pull between hosts, its bytes, paths and break-even link rates."""

from __future__ import annotations

import json

import pytest
import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv import quant
from droidmesh.shared.tools.bench import hosts

RATES = hosts.Rates(pcie_gbs=50.0, export_gbs=2.5, fixed_ms=1.0, efficiency=1.0)
W = hosts.widths("llama3-8b")  # 32 layers, 8 KV heads of 128, hidden 4096


def test_a_plans_bytes_are_its_items_at_the_shapes_widths_e_first():
    assert W == hosts.Widths(layers=32, kv_heads=8, head_dim=128, hidden=4096)
    tokens = 1000
    full = hosts.item_bytes(W, hosts.named_plan("full reuse", W.layers), tokens, "raw")
    assert len(full) == 2 * W.layers and set(full) == {W.kv_heads * W.head_dim * tokens * 2}
    k2 = hosts.item_bytes(W, hosts.named_plan("k = 2 with E", W.layers), tokens, "raw")
    assert len(k2) == 1 + 2 * (W.layers - 2)
    assert k2[0] == tokens * W.hidden * 2  # E [1, T, D] in bf16, first: recompute waits on it
    assert sum(k2) == sum(full) - 4 * full[0] + k2[0]


def test_coded_items_are_the_registrys_own_sizes():
    tokens = 512
    kv = (1, W.kv_heads, tokens, W.head_dim)
    full = hosts.named_plan("full reuse", W.layers)
    int8 = hosts.item_bytes(W, full, tokens, "int8")
    assert int8[:2] == [quant.int8_nbytes(kv, "K"), quant.int8_nbytes(kv, "V")]
    raw = hosts.item_bytes(W, full, tokens, "raw")
    int4 = hosts.item_bytes(W, full, tokens, "int4")
    assert sum(int4) < sum(int8) < sum(raw)
    assert sum(raw) == 2 * W.layers * W.kv_heads * W.head_dim * tokens * torch.bfloat16.itemsize


def test_each_path_adds_what_it_copies_on_top_of_the_wire():
    items = [64 << 20] * 10
    link = RATES.link(400.0)  # 50 GB/s: as fast as PCIe here
    wire = sum(items) / 50e9
    assert hosts.pull_seconds("gpudirect", items, link) == pytest.approx(1e-3 + wire, rel=1e-9)
    staged = hosts.pull_seconds("staged", items, link)
    assert staged == pytest.approx(1e-3 + wire + 2 * items[0] / 50e9, rel=1e-9)  # first out, last in
    today = hosts.pull_seconds("today", items, link)
    assert today == pytest.approx(1e-3 + sum(items) / 2.5e9 + wire + items[-1] / 50e9, rel=1e-9)
    assert hosts.pull_seconds("host_held", items, link) < staged < today
    slow = RATES.link(25.0)  # the link, not PCIe, is the limit
    assert hosts.pull_seconds("gpudirect", items, slow) == pytest.approx(1e-3 + sum(items) / (25e9 / 8), rel=1e-9)
    with pytest.raises(BadRequestError, match="unknown path"):
        hosts.pull_seconds("carrier pigeon", items, link)


def test_the_mesh_overlaps_the_engine_and_the_pull_after_the_fixed_cost():
    assert hosts.mesh_ttft(pull_s=0.101, engine_s=0.050, fixed_s=0.001) == pytest.approx(0.101)
    assert hosts.mesh_ttft(pull_s=0.011, engine_s=0.050, fixed_s=0.001) == pytest.approx(0.051)


def test_the_least_link_rate_is_found_and_an_unreachable_one_is_none():
    found = hosts.least_link(lambda g: g >= 37.5)
    assert found == pytest.approx(37.5, rel=1e-3) and found >= 37.5
    assert hosts.least_link(lambda g: False) is None
    assert hosts.least_link(lambda g: True) == 0.01


def _engine(tmp_path, rows):
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"rows": rows}))
    return hosts.engine_rows(path)


def test_engine_rows_take_layer_graphs_over_eager_whatever_their_order(tmp_path):
    rows = [{"context": 4096, "recomputed_layers": 2, "ttft_s": 0.026, "graphs": True},
            {"context": 4096, "recomputed_layers": 2, "ttft_s": 0.068, "graphs": False},
            {"context": 4096, "recomputed_layers": 32, "ttft_s": 0.123}]
    assert _engine(tmp_path, rows) == {(4096, 2): 0.026, (4096, 32): 0.123}
    assert _engine(tmp_path, rows[::-1]) == {(4096, 2): 0.026, (4096, 32): 0.123}
    (tmp_path / "bad.json").write_text(json.dumps({"suite": "transfer"}))
    with pytest.raises(BadRequestError, match="no rows"):
        hosts.engine_rows(tmp_path / "bad.json")


def test_break_even_agrees_with_the_rows_either_side_of_it(tmp_path):
    engine = _engine(tmp_path, [{"context": 32768, "recomputed_layers": 32, "ttft_s": 1.364},
                                {"context": 32768, "recomputed_layers": 2, "ttft_s": 0.116},
                                {"context": 32768, "recomputed_layers": 0, "ttft_s": 0.0274}])
    even = {(r["plan"], r["codec"], r["path"]): r for r in hosts.break_even("llama3-8b", [32768], ["raw", "int4"], RATES, engine)}
    assert ("full reuse", "int4", "gpudirect") not in even  # a coded item leaves a GPU sender from host memory
    k2 = even[("k = 2 with E", "raw", "gpudirect")]
    for g, pays in ((k2["pays_from_gbit_s"] * 1.01, True), (k2["pays_from_gbit_s"] * 0.99, False)):
        [row] = [r for r in hosts.rows("llama3-8b", [32768], ["raw"], [g], RATES, engine)
                 if r["plan"] == "k = 2 with E" and r["path"] == "gpudirect"]
        assert row["relay_pays"] is pays
    # 4.3 GB within twice the engine's 27 ms would need more than PCIe's 50 GB/s: no link is enough
    assert even[("full reuse", "raw", "gpudirect")]["target_from_gbit_s"] is None
    # int4 carries fewer bytes, so it pays on a slower link
    assert even[("k = 2 with E", "int4", "staged")]["pays_from_gbit_s"] < even[("k = 2 with E", "raw", "staged")]["pays_from_gbit_s"]


def test_without_the_engine_a_row_says_what_a_prefill_must_exceed():
    [row] = [r for r in hosts.break_even("smollm2-135m", [2048], ["raw"], RATES, None)
             if r["plan"] == "full reuse" and r["path"] == "gpudirect"]
    assert row["pull_at_100g_s"] == pytest.approx(1e-3 + row["wire_mb"] * 1e6 / 12.5e9, rel=1e-9)
    assert "pays_from_gbit_s" not in row


def test_engine_times_without_a_full_prefill_still_give_the_target_and_never_a_pull_as_a_mesh(tmp_path):
    engine = _engine(tmp_path, [{"context": 4096, "recomputed_layers": 2, "ttft_s": 0.026},
                                {"context": 4096, "recomputed_layers": 0, "ttft_s": 0.018}])
    for row in hosts.break_even("llama3-8b", [4096], ["raw"], RATES, engine):
        assert "pays_from_gbit_s" not in row and "pull_at_100g_s" not in row
        assert row["target_from_gbit_s"] is None or row["target_from_gbit_s"] > 25
    with pytest.raises(BadRequestError, match="unknown shape"):
        hosts.widths("gpt-7")
