"""Short passes as captured layer pieces (`shared/model/pieces.py`, `shared/model/graphs.py`).

The pieces must be the layer's own forward (every family the engine serves, Gemma 3's sliding
layers included): the same kernels on the same shapes in the same order, so equal to the bit. A
pass replayed from captured pieces must compute what the eager pass computes: here the capture
is `eager_capture`, which runs a CUDA graph's sequence (warm-up runs, then replays) eagerly from
the same fixed buffers, so what these tests hold on the CPU is what a graph relies on: every
input read from the buffers, shapes fixed per token bucket, and captures and interleaved passes
that disturb no other pass. A replayed pass runs padded to its bucket (5 tokens as 8), so its
products have other shapes than the eager pass's and may round differently: logits are held to
`tests/numeric.py`'s tolerance, greedy tokens exactly, and replays broken the ways a graph goes
wrong (a restore skipped, an input written where the graph does not read it, a buffer handed out
that the next pass overwrites) are shown to fail that comparison by far.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from droidmesh.shared.errors import UnsupportedModelError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import Generation, generate, prefill_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource, run_until
from droidmesh.shared.model import pieces
from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.model.graphs import LayerGraphs, Replay, eager_capture
from tests.conftest import FAMILIES, TINY, perturbed_copy
from tests.numeric import assert_close_computed, computed_tolerance, relative_diff
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
    assert torch.equal(h, want)  # bitwise: the layer's own kernels, shapes and order, split at the attention
    for l in range(model.num_layers):
        assert torch.equal(split.layers[l].keys, own.layers[l].keys)  # bitwise: the same k_proj and RoPE on the same shapes


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


def _short_passes(model: ModelAdapter, graphs: LayerGraphs) -> tuple[list[Generation], list[Generation]]:
    """(eager, replayed through `graphs`) generations of `_jobs`: six tokens each, one for the long prompt."""
    jobs = [(*job, n) for job, n in zip(_jobs(model), (6, 6, 6, 1), strict=True)]
    eager = [generate(model, p, plan, src, max_new_tokens=n) for p, plan, src, n in jobs]
    model.graphs = graphs
    try:
        replayed = [generate(model, p, plan, src, max_new_tokens=n) for p, plan, src, n in jobs]
    finally:
        model.graphs = None
    return eager, replayed


def _interleaved(model: ModelAdapter, graphs: LayerGraphs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(alone, interleaved) prefill logits of three reuses: alone eagerly, then stepped in turn one
    layer each through `graphs` (a service interleaves requests at their `Need`s). Two share one
    bucket's buffers, and a bucket is captured while the others are mid-pass."""
    g = torch.Generator().manual_seed(9)
    other = torch.randint(0, 97, (47,), generator=g).tolist()  # a 7-token suffix: the 5-token one's bucket
    jobs = [*_jobs(model)[:2], (other, ReusePlan.full_reuse(), CapturedSource(capture_prefill(model, other[:40])))]
    alone = [generate(model, p, plan, src, max_new_tokens=1).prefill.logits for p, plan, src in jobs]
    model.graphs = graphs
    try:
        runs = [prefill_steps(model, p, plan, src) for p, plan, src in jobs]
        done: list[Any] = [None] * len(jobs)
        while any(d is None for d in done):
            for i, steps in enumerate(runs):
                if done[i] is None:
                    finished, value = run_until(steps, lambda need: need.kind != "kv")  # stop before each layer
                    if finished:
                        done[i] = value
    finally:
        model.graphs = None
    return alone, [d.logits for d in done]


def _compare(model: ModelAdapter, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close_computed(a, b, dtype=model.dtype, layers=model.num_layers, what=f"pass {i}")


def test_short_passes_replayed_from_layer_graphs_equal_eager_ones(model):
    """With layer graphs, every plan's prefill logits (within the tolerance) and greedy tokens (the
    decode steps of one request are passes of one token) equal the eager engine's; a pass longer
    than the largest bucket runs eagerly, capturing nothing."""
    graphs = LayerGraphs(model, eager_capture)
    eager, replayed = _short_passes(model, graphs)
    assert {tb for tb, _, _ in graphs.graphs} == {1, 8, 32}  # decode steps, the 5-token suffix, the rest; none of 128
    for a, b in zip(eager, replayed, strict=True):
        assert a.tokens == b.tokens
    _compare(model, [b.prefill.logits for b in replayed], [a.prefill.logits for a in eager])


def test_passes_interleaved_between_layers_disturb_nothing(model):
    """Three reuses stepped in turn, one layer each: each gets the logits it gets alone."""
    alone, interleaved = _interleaved(model, LayerGraphs(model, eager_capture))
    _compare(model, interleaved, alone)


class _Unrestored(LayerGraphs):
    """The after-graph captured without saving and restoring `h`: the capture's warm-up runs apply
    the layer to the pass under way, which then applies it once more."""

    def _graph(self, tb: int, l: int, piece: str) -> Replay:
        key = (tb, l, piece)
        if piece != "after" or key in self.graphs:
            return super()._graph(tb, l, piece)
        buf, layer, kind = self._buffers(tb), self.model.model.model.layers[l], self.model.config.model_type
        self.graphs[key] = self.capture(lambda: (buf.h.copy_(pieces.after(layer, kind, buf.o, buf.h)),))
        return self.graphs[key]


class _StalePositions(LayerGraphs):
    """Each pass writes its positions into a copy of the bucket's buffer, not the one its graphs
    read: they rotate by the positions the buffer held at capture."""

    def _buffers(self, tb: int) -> Any:
        buf = super()._buffers(tb)
        return dataclasses.replace(buf, positions=buf.positions.clone())


class _Uncopied(LayerGraphs):
    """A pass handed out as its bucket's buffer itself, not a copy: a pass of another request in
    that bucket, run between two of its layers, overwrites it."""

    def run(self, h: torch.Tensor, start: int, end: int, cache: Any, past: int) -> torch.Tensor:
        t = h.shape[1]
        super().run(h, start, end, cache, past)
        return self.buffers[next(b for b in self.token_buckets if b >= t)].h[:, :t]


def _short_logits(model: ModelAdapter, graphs: LayerGraphs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    eager, replayed = _short_passes(model, graphs)
    return [g.prefill.logits for g in eager], [g.prefill.logits for g in replayed]


BROKEN = {"restore skipped": (_Unrestored, _short_logits),
          "stale positions": (_StalePositions, _short_logits),
          "buffer handed out": (_Uncopied, _interleaved)}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_wrong_replay_fails_the_tolerance_by_far(broken):
    """Each breakage moves some pass's logits over a hundred times the tolerance the right replay
    meets, and the tests' comparison refuses it."""
    kind, scenario = BROKEN[broken]
    model = _model("llama")
    want, got = scenario(model, kind(model, eager_capture))
    worst = max(relative_diff(a, b) for a, b in zip(got, want, strict=True))
    assert worst > 100 * computed_tolerance(model.dtype, model.num_layers), worst
    with pytest.raises(AssertionError, match="max"):
        _compare(model, got, want)


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
