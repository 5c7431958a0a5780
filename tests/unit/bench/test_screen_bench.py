"""`bench screen`'s suite (`shared/tools/bench/screen.py`) on the tiny random pair: honest captures
pass the receiver's screen, all-zero ones never do, attacks on what a plan does not pull are left
out, and attacks run on every N-th context only when asked."""

from __future__ import annotations

import torch

from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.tools.bench import screen as suite

TOKENS = 96


def _contexts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 200, (TOKENS,), generator=g).tolist() for _ in range(n)]


def test_honest_pulls_pass_and_zeros_are_caught(tiny_models):
    sender, receiver = tiny_models
    result = suite.run_pair(suite.Pair("s->r", sender, receiver, ReusePlan.recompute(2, 4)), _contexts(4),
                            progress=False)
    assert result["honest_pulls"] == 4 and result["false_positives"] == 0, result["refusals"]
    rows = {a["attack"]: a for a in result["attacks"]}
    assert rows["zeros"]["caught"] == rows["zeros"]["trials"] == 4
    assert rows["other_context"]["trials"] == 3  # the first context has no previous one
    assert "flip_E" in rows and set(rows) == set(suite.attacks())
    table = suite.table_rows([result])
    assert table[0]["pulls"] == "honest" and len(table) == 1 + len(rows)


def test_an_attack_on_what_the_plan_does_not_pull_is_left_out_and_attacks_can_be_sparse(tiny_models):
    sender, receiver = tiny_models
    result = suite.run_pair(suite.Pair("s->r", sender, receiver, ReusePlan.full_reuse()), _contexts(5),
                            attack_every=2, progress=False)
    rows = {a["attack"]: a for a in result["attacks"]}
    assert "flip_E" not in rows  # full reuse pulls no E
    assert result["honest_pulls"] == 5 and rows["zeros"]["trials"] == 3  # contexts 0, 2, 4


def test_the_attacks_change_what_they_say(tiny_models):
    sender, _ = tiny_models
    from droidmesh.shared.kv.capture import capture_prefill

    a, b = (capture_prefill(sender, ids, e_layers=[2]) for ids in _contexts(2))
    g = torch.Generator().manual_seed(0)
    kinds = suite.attacks()
    flipped = kinds["flip_K"](a, b, [0, 1], g)
    # bitwise: a sign flip and a copy change no value's bits but the sign
    assert torch.equal(flipped.kv[0].k, -a.kv[0].k) and torch.equal(flipped.kv[0].v, a.kv[0].v)
    two = kinds["flip_KV_2_layers"](a, b, [4, 5, 0], g)
    # bitwise: the same tensors, negated or passed through
    assert torch.equal(two.kv[4].v, -a.kv[4].v) and torch.equal(two.kv[0].k, a.kv[0].k)
    other = kinds["other_context"](a, b, [], g)
    # bitwise: the other capture's tensors, passed through
    assert other.token_ids == a.token_ids and torch.equal(other.kv[1].k, b.kv[1].k)
