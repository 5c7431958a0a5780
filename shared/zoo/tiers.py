"""The two zoo tiers as recipes.

Both share one shape (the zoo README says why each piece is there):
  base   echo stage (layer 0 learns previous-token heads) -> re-initialise layers >= 1 ->
         lookup stage with layer 0's attention frozen and attention supervision on the READER
         layer (its heads must land on the asked key's value) -> longer, multi-document
         contexts with filler (demo: ~1K-token contexts).
  qa     receiver for `multihop_qa`: alias embeddings start as copies of their keys'; trains
         only layer reader-1 (+ the alias embeddings).
         Aliases move only question tokens; the `coded` rule can only be learned as a change
         of how layer reader-1 encodes the context's values, which is exactly what a sender's
         KV then lacks (the fine-tune must change the ENCODING of the context).
  summ   a gentle full fine-tune on `summarization` (lists document titles).
  code   a peft LoRA adapter fine-tuned on stdlib source (`code_completion`).
"""

from __future__ import annotations

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model.names import Pair
from droidmesh.shared.tasks.suite import SuiteShape
from droidmesh.shared.zoo.recipe import Derivative, Op, Recipe
from droidmesh.shared.zoo.train import Arch, Stage

LOOKUP = (("recall", 0.5), ("ask", 0.3), ("echo", 0.2))
PAIRS = (
    Pair("base", "qa", "multihop_qa"),
    Pair("summ", "qa", "multihop_qa"),
    Pair("qa", "summ", "summarization"),
    Pair("summ", "code", "code_completion"),
)


def demo_recipe() -> Recipe:
    R = 5  # reader layer of the 12-layer base
    arch = Arch(layers=12, hidden=128, heads=4, kv_heads=4, intermediate=320, max_positions=4096, rope_theta=500000.0)
    base_ops = (
        Op("new", arch=arch),
        Op("train", stage=Stage("echo", 150, 3e-3, 32, (("echo", 1.0),))),
        Op("reinit_above", n=1),
        Op("train", stage=Stage("lookup", 600, 3e-3, 32, LOOKUP, facts=(2, 6), filler=(0, 20),
                                freeze_attn0=True, attn_sup=1.0, attn_layer=R)),
        Op("train", stage=Stage("medium", 250, 1e-3, 8, (("ask", 0.5), ("recall", 0.4), ("echo", 0.1)),
                                facts=(4, 16), docs=(1, 5), filler=(0, 300), attn_sup=0.3, attn_layer=R)),
        Op("train", stage=Stage("long", 100, 5e-4, 4, (("ask", 0.6), ("recall", 0.4)), facts=(8, 16), docs=(3, 5),
                                filler=(850, 1000), lookups=16)),
    )
    derivatives = (
        Derivative("qa", "full", "multihop_qa", (
            Stage("qa", 1500, 3e-3, 8, (("who", 1.0),), facts=(2, 8), filler=(0, 60), coded_frac=0.5,
                  train="layers:reader-1+alias"),
            Stage("qa_long", 100, 1e-3, 4, (("who", 1.0),), facts=(8, 16), docs=(3, 5), filler=(850, 1000),
                  lookups=16, coded_frac=0.5, train="layers:reader-1+alias"),
        ), init_aliases=True),
        Derivative("summ", "full", "summarization", (
            Stage("summ", 200, 3e-4, 8, (("titles", 1.0),), facts=(4, 12), docs=(2, 5), filler=(0, 300)),
        )),
        Derivative("code", "lora", "code_completion", (
            Stage("code", 150, 1e-3, 8, (("code", 1.0),), seq_len=256),
        )),
    )
    return Recipe("demo", 1234, base_ops, derivatives, PAIRS, SuiteShape(), threads=1, eval_rows=48)


def ci_recipe() -> Recipe:
    R = 2
    arch = Arch(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=4096, rope_theta=500000.0)
    base_ops = (
        Op("new", arch=arch),
        Op("train", stage=Stage("echo", 60, 3e-3, 16, (("echo", 1.0),))),
        Op("reinit_above", n=1),
        Op("train", stage=Stage("lookup", 300, 3e-3, 16, LOOKUP, facts=(2, 4), freeze_attn0=True,
                                attn_sup=1.0, attn_layer=R)),
        Op("grow", placement=(0, 1, 2, None, 3, None)),
        Op("train", stage=Stage("medium", 30, 1e-3, 8, (("ask", 0.5), ("recall", 0.5)), facts=(4, 8), docs=(1, 3),
                                filler=(0, 100), attn_sup=0.5, attn_layer=R)),
    )
    derivatives = (
        Derivative("qa", "full", "multihop_qa", (
            Stage("qa", 120, 2e-3, 8, (("who", 1.0),), facts=(2, 6), docs=(1, 2), filler=(0, 50), coded_frac=0.5,
                  train="layers:reader-1+alias"),
        ), init_aliases=True),
        Derivative("summ", "full", "summarization", (
            Stage("summ", 20, 3e-4, 8, (("titles", 1.0),), facts=(2, 6), docs=(2, 4), filler=(0, 50)),
        )),
        Derivative("code", "lora", "code_completion", (
            Stage("code", 10, 1e-3, 4, (("code", 1.0),), seq_len=96),
        ), lora_r=4),
    )
    shape = SuiteShape(facts=(4, 8), docs=(2, 3), filler=(100, 200), code_tokens=200)
    return Recipe("ci", 7, base_ops, derivatives, PAIRS, shape, threads=1, eval_rows=8)


TIERS = {"demo": demo_recipe, "ci": ci_recipe}


def get_recipe(tier: str) -> Recipe:
    if tier not in TIERS:
        raise BadRequestError(f"unknown zoo tier {tier!r}; expected one of {sorted(TIERS)}")
    return TIERS[tier]()
