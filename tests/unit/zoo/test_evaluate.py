"""Pair evaluation logic on tiny random models (no zoo build needed)."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.model.adapter import ModelAdapter, random_model
from shared.zoo.evaluate import all_groups, evaluate_pair, must_show, per_layer_plan
from shared.zoo.suite import SuiteShape, TASKS, make_rows
from shared.zoo.tokenizer import WordIds, hf_tokenizer

L = 4


@pytest.fixture(scope="module")
def pair() -> tuple[ModelAdapter, ModelAdapter]:
    vocab = WordIds().vocab_size
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=1024)
    base = random_model("llama", seed=0, **cfg)
    recv = ModelAdapter(model=base.model, tokenizer=hf_tokenizer(), name="receiver")
    send = ModelAdapter(model=copy.deepcopy(recv.model), tokenizer=recv.tokenizer, name="sender")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in send.model.model.layers[1].parameters():  # the sender differs in layer 1 only
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return send, recv


def test_per_layer_plan_recomputes_everything_but_one_layer() -> None:
    """Reusing only layer l recomputes [0,l) and [l+1,L); empty groups are dropped."""
    assert per_layer_plan(0, 4).groups == ((1, 4),)
    assert per_layer_plan(2, 4).groups == ((0, 2), (3, 4))
    assert per_layer_plan(3, 4).groups == ((0, 3),)


def test_all_groups_enumerates_contiguous_groups() -> None:
    """All contiguous groups of every size: L(L+1)/2 of them."""
    gs = all_groups(4)
    assert len(gs) == 10 and (0, 4) in gs and (3, 4) in gs
    assert all_groups(4, [2]) == [(0, 2), (1, 3), (2, 4)]


def test_eval_json_has_required_keys_and_consistent_paths(pair) -> None:
    """The eval JSON has every required key; full prefill is its own reference (KL 0, top-1 1);
    with a sender equal to the receiver below layer 1, recomputing [1,L) matches full prefill."""
    send, recv = pair
    rows = make_rows("multihop_qa", "test", 2, SuiteShape(facts=(3, 4), docs=(1, 2), filler=(10, 20)))
    ev = evaluate_pair(send, recv, rows, TASKS["multihop_qa"], progress=False)
    for k in ("total_layers", "sender_alone", "receiver_full_prefill", "receiver_full_reuse", "per_layer_reuse", "best_groups"):
        assert k in ev
    assert ev["total_layers"] == L
    assert [p["layer"] for p in ev["per_layer_reuse"]] == list(range(L))
    assert [g["recomputed_layers"] for g in ev["best_groups"]] == list(range(1, L + 1))
    fp = ev["receiver_full_prefill"]
    assert fp["kl"] == 0.0 and fp["top1_agreement"] == 1.0
    g12 = next(g for g in ev["groups"] if (g["start"], g["end"]) == (1, L))
    assert g12["kl"] == pytest.approx(0.0, abs=1e-6)
    assert g12["answer_nll"] == pytest.approx(fp["answer_nll"], abs=1e-4)
    assert ev["per_layer_reuse"][0]["kl"] == pytest.approx(0.0, abs=1e-6)  # layer 0 is identical
    for path in [ev["sender_alone"], ev["receiver_full_reuse"], *ev["per_layer_reuse"]]:
        assert 0.0 <= path["quality"] <= 1.0


def test_must_show_summary_known_answer() -> None:
    """must_show: relative loss, critical layers (>5% drop) and the smallest restoring group."""
    q = lambda v: {"quality": v, "answer_nll": 0.0}
    ev = {
        "total_layers": 4, "receiver_full_prefill": q(1.0), "receiver_full_reuse": q(0.5), "sender_alone": q(0.1),
        "per_layer_reuse": [{"layer": 0, **q(1.0)}, {"layer": 1, **q(0.6)}, {"layer": 2, **q(0.97)}, {"layer": 3, **q(1.0)}],
        "best_groups": [{"start": 1, "end": 2, "recomputed_layers": 1, **q(0.9)},
                        {"start": 1, "end": 3, "recomputed_layers": 2, **q(0.96)}],
    }
    s = must_show(ev)
    assert s["full_reuse_relative_loss"] == 0.5 and s["full_reuse_above_sender"]
    assert s["critical_layers"] == [1] and s["critical_fraction"] == 0.25
    assert s["smallest_restoring_group"]["start"] == 1 and s["smallest_restoring_group"]["end"] == 3
