"""Training helpers: growth, lookup links, recipe hashing, trainable-layer resolution."""

from __future__ import annotations

import dataclasses
import random

import torch

from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.zoo.build import _resolve_train
from droidmesh.shared.zoo.recipe import ops_hash, recipe_hash
from droidmesh.shared.zoo.tiers import get_recipe
from droidmesh.shared.zoo.tokenizer import WordIds
from droidmesh.shared.zoo.train import (
    Arch,
    Stage,
    grow,
    lookup_links,
    new_model,
    sample_sequence,
    select_trainable,
)


def test_grow_with_identity_layers_keeps_the_function() -> None:
    """Inserted layers (zero o_proj/down_proj) are identities: the grown model's logits equal the shallow one's."""
    ids = WordIds()
    small = new_model(Arch(2, 32, 4, 2, 64), ids, seed=0)
    big = grow(small, [0, None, 1, None], ids, seed=1)
    x = torch.tensor([[ids.bos] + ids.seq(["anna", "amber", ".", "ask", "anna"])])
    with torch.no_grad():
        assert torch.allclose(small(input_ids=x).logits, big(input_ids=x).logits, atol=1e-5)
    assert big.config.num_hidden_layers == 4


def test_lookup_links_point_at_the_asked_keys_value() -> None:
    """Each link goes from a question's key token to the context position of that key's value."""
    ids = WordIds()
    stage = Stage("s", 1, 0.0, 1, (("ask", 1.0),), facts=(3, 3), lookups=4)
    seq, mask = sample_sequence(stage, random.Random(3), ids)
    links = lookup_links(seq, mask, ids)
    assert len(links) == 4
    for q, f in links:
        assert seq[f - 1] == seq[q]  # the fact's key is the asked key
        assert seq[q + 1] == seq[f]  # and the answer is the fact's value


def test_alias_only_training_moves_only_alias_rows() -> None:
    """`layers:i+alias` trains layer i and masks embedding gradients to the alias rows."""
    ids = WordIds()
    m = new_model(Arch(3, 32, 4, 2, 64), ids, seed=0)
    _params, hook = select_trainable(m, Stage("s", 1, 0.0, 1, (("who", 1.0),), train="layers:1+alias"), ids)
    assert all(p.requires_grad for p in m.model.layers[1].parameters())
    assert not any(p.requires_grad for p in m.model.layers[0].parameters())
    m.model.embed_tokens.weight.grad = torch.ones_like(m.model.embed_tokens.weight)
    hook()
    g = m.model.embed_tokens.weight.grad
    assert g[ids[V.ALIASES[0]]].abs().sum() > 0 and g[ids[V.KEYS[0]]].abs().sum() == 0


def test_resolve_train_relative_to_reader() -> None:
    """`reader-1` resolves against the probed reader layer."""
    assert _resolve_train("layers:reader-1+alias", 5) == "layers:4+alias"
    assert _resolve_train("layers:reader-2,reader", 5) == "layers:3,5"
    assert _resolve_train("all", 5) == "all"


def test_recipe_hash_tracks_the_recipe() -> None:
    """Same recipe -> same hash; changing a derivative changes the recipe hash but not the base-op cache keys."""
    r = get_recipe("ci")
    assert recipe_hash(r) == recipe_hash(get_recipe("ci"))
    d0 = r.derivatives[0]
    one_step = dataclasses.replace(d0, stages=(dataclasses.replace(d0.stages[0], steps=1),))
    changed = dataclasses.replace(r, derivatives=(one_step,) + r.derivatives[1:])
    assert recipe_hash(changed) != recipe_hash(r)
    assert ops_hash(changed, len(r.base_ops)) == ops_hash(r, len(r.base_ops))
