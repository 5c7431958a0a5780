"""Short passes as captured layer pieces (`shared/model/pieces.py`, `shared/model/graphs.py`).

The pieces must be the layer's own forward (every family the engine serves, Gemma 3's sliding
layers included; float32 on one thread, so equal to the bit), and a pass replayed from captured
pieces must equal the eager pass: here the capture is `eager_capture`, which runs a CUDA
graph's sequence (warm-up runs, then replays) eagerly from the same fixed buffers, so what these
tests hold on the CPU is what a graph relies on: every input read from the buffers, shapes
fixed per token bucket, and captures and interleaved passes that disturb no other pass.
"""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource, run_until
from droidmesh.shared.model import pieces
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.model.graphs import LayerGraphs, eager_capture
from tests.conftest import FAMILIES, TINY, perturbed_copy
from tests.unit.model.test_gemma3 import tiny_gemma3

MORE = {"qwen3": dict(TINY, num_key_value_heads=2, head_dim=16),  # q / k norms
        "mistral": dict(TINY, num_key_value_heads=2, sliding_window=8)}


def _model(family: str) -> ModelAdapter:
    if family == "gemma3_text":
        return tiny_gemma3(seed=0)  # sliding layers of window 8
    return random_model(family, seed=0, **{**FAMILIES, **MORE}[family])


@pytest.fixture(params=["llama", "qwen2", "qwen3", "mistral", "gemma3_text"], scope="module")
def model(request: pytest.FixtureRequest) -> ModelAdapter:
    return _model(request.param)


def test_a_layer_in_pieces_is_the_layers_own_forward(model):
    """Before, attend and after, layer by layer over a cached prefix, give the layers' own
    forward (`run_layers`) exactly, and leave the same cache."""
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        own, split = model.new_cache(40), model.new_cache(40)
        for cache in (own, split):
            model.run_layers(model.embed(ids[:, :20]), 0, model.num_layers, cache, past=0)
        want = model.run_layers(model.embed(ids[:, 20:]), 0, model.num_layers, own, past=20)
        h, positions = model.embed(ids[:, 20:]), torch.arange(20, 30)[None]
        for l, layer in enumerate(model.model.model.layers):
            cos, sin = model._rope(h, positions, l)
            h = pieces.layer_forward(layer, model.config.model_type, h, cos, sin, split, model.windows[l])
    assert torch.equal(h, want)
    for l in range(model.num_layers):
        assert torch.equal(split.layers[l].keys, own.layers[l].keys)


def _jobs(model: ModelAdapter) -> list[tuple[list[int], ReusePlan, CapturedSource | None]]:
    """A full reuse (5-token suffix), a partial plan (27-token suffix: another bucket), a short
    full prefill (9 tokens) and one of 140 tokens (past the largest bucket: eager)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (45, 57, 9, 140)]
    sender = perturbed_copy(model, range(1, 3))
    return [(prompts[0], ReusePlan.full_reuse(), CapturedSource(capture_prefill(model, prompts[0][:40]))),
            (prompts[1], ReusePlan.recompute(0, 2), CapturedSource(capture_prefill(sender, prompts[1][:30], e_layers=[0]))),
            (prompts[2], ReusePlan.full_prefill(), None),
            (prompts[3], ReusePlan.full_prefill(), None)]


def test_short_passes_replayed_from_layer_graphs_equal_eager_ones(model):
    """With layer graphs, every plan's prefill logits and greedy tokens (the decode steps of one
    request are passes of one token) equal the eager engine's; a pass longer than the largest
    bucket runs eagerly, capturing nothing."""
    jobs = _jobs(model)
    eager = [generate(model, p, plan, src, max_new_tokens=6) for p, plan, src in jobs]
    model.graphs = LayerGraphs(model, eager_capture)
    try:
        replayed = [generate(model, p, plan, src, max_new_tokens=6) for p, plan, src in jobs[:3]]
        assert {tb for tb, _, _ in model.graphs.graphs} == {1, 8, 32}  # decode steps, the 5-token suffix, the rest
        long = generate(model, *jobs[3], max_new_tokens=1)
        assert {tb for tb, _, _ in model.graphs.graphs} == {1, 8, 32}
    finally:
        model.graphs = None
    for a, b in zip(eager, [*replayed, long], strict=True):
        assert a.tokens[:len(b.tokens)] == b.tokens
        assert torch.equal(a.prefill.logits, b.prefill.logits)


def test_passes_interleaved_between_layers_disturb_nothing(model):
    """Three reuses stepped in turn, one layer each (a service interleaves requests at their
    `Need`s): two share one bucket's buffers, and a bucket is captured while the others are
    mid-pass; each gets the logits it gets alone."""
    g = torch.Generator().manual_seed(9)
    other = torch.randint(0, 97, (47,), generator=g).tolist()  # a 7-token suffix: the 5-token one's bucket
    jobs = [*_jobs(model)[:2], (other, ReusePlan.full_reuse(), CapturedSource(capture_prefill(model, other[:40])))]
    alone = [generate(model, p, plan, src, max_new_tokens=1).prefill.logits for p, plan, src in jobs]
    model.graphs = LayerGraphs(model, eager_capture)
    try:
        runs = [prefill_steps(model, p, plan, src) for p, plan, src in jobs]
        done: list[object] = [None] * len(jobs)
        while any(d is None for d in done):
            for i, steps in enumerate(runs):
                if done[i] is None:
                    finished, value = run_until(steps, lambda need: need.kind != "kv")  # stop before each layer
                    if finished:
                        done[i] = value
    finally:
        model.graphs = None
    for pre, want in zip(done, alone, strict=True):
        assert torch.equal(pre.logits, want)  # type: ignore[attr-defined]


def test_a_layer_without_the_pieces_modules_is_refused():
    model = _model("llama")
    layer = model.model.model.layers[0]
    mlp = layer.mlp
    del layer.mlp
    try:
        with pytest.raises(UnsupportedModelError, match="mlp"):
            LayerGraphs(model, eager_capture)
    finally:
        layer.mlp = mlp
