"""The one scorer and the eval report on tiny random models (no zoo build needed)."""

from __future__ import annotations

import copy

import pytest
import torch

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.profiling import layer_codecs
from droidmesh.shared.tasks.evaluation import all_groups, evaluate_pair, must_show
from droidmesh.shared.tasks.scorer import PairScorer, per_layer_plan, score_text
from droidmesh.shared.tasks.spec import TASKS, task_spec
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.zoo.tokenizer import WordIds, hf_tokenizer

SHAPE = SuiteShape(facts=(3, 4), docs=(1, 2), filler=(10, 20))

L = 4


@pytest.fixture(scope="module")
def pair() -> tuple[ModelAdapter, ModelAdapter]:
    vocab = WordIds().vocab_size
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": L, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 1024}
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
    rows = make_rows("multihop_qa", "test", 2, SHAPE)
    ev = evaluate_pair(send, recv, rows, TASKS["multihop_qa"], progress=False)
    for k in ("total_layers", "sender_alone", "receiver_full_prefill", "receiver_full_reuse", "per_layer_reuse", "best_groups"):
        assert k in ev
    assert ev["total_layers"] == L
    assert [p["layer"] for p in ev["per_layer_reuse"]] == list(range(L))
    assert [g["recomputed_layers"] for g in ev["best_groups"]] == list(range(1, L + 1))
    fp = ev["receiver_full_prefill"]
    assert fp["kl"] == 0.0 and fp["top1_agreement"] == 1.0 and fp["greedy_agreement"] == 1.0
    g12 = next(g for g in ev["groups"] if (g["start"], g["end"]) == (1, L))
    assert g12["kl"] == pytest.approx(0.0, abs=1e-6) and g12["greedy_agreement"] == 1.0
    assert g12["answer_nll"] == pytest.approx(fp["answer_nll"], abs=1e-4)
    assert ev["per_layer_reuse"][0]["kl"] == pytest.approx(0.0, abs=1e-6)  # layer 0 is identical
    for path in [ev["sender_alone"], ev["receiver_full_reuse"], *ev["per_layer_reuse"]]:
        assert 0.0 <= path["quality"] <= 1.0


def test_strided_eval_keeps_the_top_group_and_skips_probes(pair) -> None:
    """A 30-layer model cannot afford every group on a CPU: strides thin them, the topmost start stays."""
    from droidmesh.shared.tasks.evaluation import all_groups

    assert all_groups(30, [6], stride=6) == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30)]
    assert all_groups(30, [3], stride=6)[-1] == (27, 30)
    send, recv = pair
    ev = evaluate_pair(send, recv, make_rows("multihop_qa", "test", 1, SHAPE), TASKS["multihop_qa"], group_sizes=[2],
                       group_stride=3, layer_stride=0, progress=False)
    assert ev["per_layer_reuse"] == [] and [(g["start"], g["end"]) for g in ev["groups"]] == [(0, 2), (L - 2, L)]


def test_must_show_summary_known_answer() -> None:
    """must_show: relative loss, critical layers (>5% drop) and the smallest restoring group."""
    def q(v):
        return {"quality": v, "answer_nll": 0.0}
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


def test_quality_and_the_eval_paths_are_one_computation(pair) -> None:
    """The profiler's `quality(plan)` equals the eval report's per-path quality for the same
    rows and plans (both come from the one scorer), including the per-layer probe."""
    send, recv = pair
    rows = make_rows("summarization", "test", 2, SHAPE)
    spec = TASKS["summarization"]
    scorer = PairScorer(send, recv, rows, spec)
    plans = {"reuse": ReusePlan.full_reuse(), "layer/2": per_layer_plan(2, L), "group": ReusePlan.recompute(1, 3)}
    per_row = list(scorer.paths(plans))
    for name, plan in plans.items():
        assert scorer.quality(plan) == pytest.approx(sum(r[name].quality for r in per_row) / len(rows))
    assert scorer.quality(ReusePlan.full_prefill()) == pytest.approx(
        sum(r["receiver_full_prefill"].quality for r in per_row) / len(rows))
    assert scorer.sender_alone() == pytest.approx(sum(r["sender_alone"].quality for r in per_row) / len(rows))
    assert 0.0 <= scorer(ReusePlan.swap([2])) <= 1.0  # the profiler's probe is scored the same way


def test_scorer_with_an_identical_sender_matches_full_prefill(pair) -> None:
    """A sender equal to the receiver: every plan answers exactly as full prefill does."""
    _, recv = pair
    rows = make_rows("multihop_qa", "test", 2, SHAPE)
    scorer = PairScorer(recv, recv, rows, TASKS["multihop_qa"])
    res = next(scorer.paths({"reuse": ReusePlan.full_reuse()}))
    assert res["reuse"].prediction == res["receiver_full_prefill"].prediction
    assert scorer.quality(ReusePlan.full_reuse()) == scorer.quality(ReusePlan.full_prefill())


def test_score_text_cuts_and_strips_like_the_scorer() -> None:
    """The demo's text from a receiver service is scored as the scorer scores decoded ids:
    cut at the first stop string, stripped (code keeps its indentation)."""
    qa = task_spec("multihop_qa")
    assert score_text(qa, " amber . anna", ["amber"]) == 1.0
    assert score_text(qa, "anna amber", ["amber"]) < 1.0
    code = task_spec("code_completion")
    assert score_text(code, "\n    return x\n", ["    return x"]) == 1.0
    two = task_spec("custom", stop=(" end", " ."))
    assert score_text(two, "anna . amber end", ["anna"]) == 1.0


def test_scorer_rejects_no_rows(pair) -> None:
    """Scoring on zero rows is an error, not a division by zero later."""
    send, recv = pair
    with pytest.raises(ValueError, match="no rows"):
        PairScorer(send, recv, [], TASKS["multihop_qa"])


def test_divergences_are_zero_where_a_plan_reproduces_full_prefill_and_grow_row_by_row(pair) -> None:
    """The fidelity signal: full prefill against itself is 0 on every row; recomputing [1, L) (the
    sender equals the receiver below layer 1) matches it within float error; full reuse (layer 1's
    KV from the perturbed sender) diverges. Rows asked for later extend the memo, never rescore."""
    send, recv = pair
    rows = make_rows("multihop_qa", "test", 3, SHAPE)
    scorer = PairScorer(send, recv, rows, TASKS["multihop_qa"])
    assert scorer.divergences(ReusePlan.full_prefill()) == [0.0, 0.0, 0.0]
    assert scorer.divergences(ReusePlan.recompute(1, L)) == pytest.approx([0.0] * 3, abs=1e-5)
    reuse = scorer.divergences(ReusePlan.full_reuse(), rows=2)
    assert len(reuse) == 2 and min(reuse) > 1e-4
    first = scorer.scores(ReusePlan.full_reuse(), rows=1)
    calls: list[int] = []
    original = scorer._score
    scorer._score = lambda *a, **k: calls.append(a[1]) or original(*a, **k)  # type: ignore[method-assign]
    assert scorer.scores(ReusePlan.full_reuse(), rows=3)[:1] == first and calls == [1, 2]
    assert scorer.divergences(ReusePlan.full_reuse())[:2] == reuse


def test_a_divergence_is_read_through_the_wire_asked_for(pair) -> None:
    """Recomputing [1, L) reuses only layer 0, the same in both models: raw matches full prefill
    within float error; the same plan with layer 0 sent int8, then int4, diverges more over
    the rows with fewer bits. Each wire has its own memo: raw's is not rescored or replaced."""
    send, recv = pair
    scorer = PairScorer(send, recv, make_rows("multihop_qa", "test", 2, SHAPE), TASKS["multihop_qa"])
    plan = ReusePlan.recompute(1, L)
    raw = scorer.divergences(plan)
    int8 = scorer.divergences(plan, wire=layer_codecs.wire_for(plan, L, []))
    int4 = scorer.divergences(plan, wire=layer_codecs.wire_for(plan, L, [0]))
    assert raw == pytest.approx([0.0] * 2, abs=1e-5)
    # ~1e-7 nats a row (layer 0 of a tiny random model): int4's step is 16x int8's, so over the rows
    # it diverges more; per row the two can swap (K's int4 groups follow its channels, int8 too)
    assert int8 != raw and sum(int8) < sum(int4), (raw, int8, int4)
    assert scorer.divergences(plan) == raw


def test_fill_scores_row_by_row_as_plan_major_calls_do_and_keeps_no_capture(pair) -> None:
    """`fill` gives each plan the scores `scores` gives it, with one capture per row, none kept."""
    send, recv = pair
    rows = make_rows("multihop_qa", "test", 3, SHAPE)
    plans = [ReusePlan.full_prefill(), ReusePlan.full_reuse(), ReusePlan.recompute(1, 3)]
    a, b = PairScorer(send, recv, rows, TASKS["multihop_qa"]), PairScorer(send, recv, rows, TASKS["multihop_qa"])
    captures: list[int] = []
    original = b._capture
    b._capture = lambda i: captures.append(i) or original(i)  # type: ignore[method-assign]
    b.scores(plans[1], rows=1)  # a plan-major start keeps row 0's capture
    b.fill(plans)
    assert captures == [0, 1, 2] and list(b._captured) == [0]
    assert all(b.scores(p) == a.scores(p) for p in plans)
    c = PairScorer(send, recv, rows, TASKS["multihop_qa"])
    c.scores(ReusePlan.full_prefill())
    assert c._captured == {}  # full prefill reads nothing of the sender: no capture


def test_every_eval_path_carries_its_interval_against_full_prefill(pair) -> None:
    """The eval JSON: each path but full prefill has its paired relative difference, interval and
    verdict; [1, L) reproduces full prefill on every row, so its interval is [0, 0]: within."""
    send, recv = pair
    rows = make_rows("multihop_qa", "test", 3, SHAPE)
    ev = evaluate_pair(send, recv, rows, TASKS["multihop_qa"], group_sizes=[L - 1], layer_stride=0, progress=False)
    assert "vs_full_prefill" not in ev["receiver_full_prefill"]
    for path in (ev["receiver_full_reuse"], ev["sender_alone"], *ev["groups"]):
        v = path["vs_full_prefill"]
        assert v["verdict"] in ("within", "below", "undecided")
        assert v["interval"] is None or v["interval"][0] <= v["relative"] <= v["interval"][1]
    g = next(g for g in ev["groups"] if (g["start"], g["end"]) == (1, L))
    if ev["receiver_full_prefill"]["quality"] > 0:
        assert g["vs_full_prefill"] == {"relative": 0.0, "interval": [0.0, 0.0], "verdict": "within"}


def test_an_eval_path_that_wins_by_noise_is_undecided() -> None:
    """Constructed rows: a path with full prefill's mean but independent answers is undecided, not within."""
    from droidmesh.shared.tasks.evaluation import _Acc

    ref, noisy = _Acc(), _Acc()
    ref.q = [1.0, 0.0] * 20
    noisy.q = [0.0, 1.0] * 20
    v = noisy.summary(ref)["vs_full_prefill"]
    assert v["relative"] == 0.0 and v["verdict"] == "undecided"


def test_a_bounded_scorer_keeps_the_latest_captures_and_makes_the_rest_again(pair) -> None:
    """`max_captures=2` over 3 rows: the least recently used capture goes, and asking its row
    again captures it again; scores are those of an unbounded scorer."""
    send, recv = pair
    rows = make_rows("multihop_qa", "test", 3, SHAPE)
    free, bounded = (PairScorer(send, recv, rows, TASKS["multihop_qa"], max_captures=m) for m in (None, 2))
    captures: list[int] = []
    original = bounded._capture
    bounded._capture = lambda i: captures.append(i) or original(i)  # type: ignore[method-assign]
    plan = ReusePlan.recompute(1, 3)
    assert bounded.scores(ReusePlan.full_reuse()) == free.scores(ReusePlan.full_reuse())
    assert list(bounded._captured) == [1, 2]
    assert bounded.scores(plan) == free.scores(plan)
    assert captures == [0, 1, 2, 0, 1, 2]  # row 0 made again, which pushed out row 1, and so on
