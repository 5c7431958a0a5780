"""Captured replays of the engine's fixed-shape work (CUDA graphs), and the layer graphs of a short pass.

On a GPU a short pass is bound by the host: a decoder layer's forward launches about 50 kernels
of microseconds each, so a 32-token suffix through 32 layers over a cached 64K-token prefix spent
~60 ms issuing ~1,700 launches against ~29 ms of kernels. A CUDA graph replays a captured
sequence of kernels with one launch. Two users:

  - the decode pool's step (`shared/kv/pool.py`): one graph per (batch, keys) bucket;
  - `LayerGraphs`, a pass of T <= 128 new tokens (a suffix over a reused prefix, a decode step of
    one request, a short prompt): each layer runs as its pieces (`shared/model/pieces.py`), the
    part before the attention and the part after it replayed from one graph each per token
    bucket, the attention between them eager over the request's own cache, whose length no
    graph depends on. Per layer: two replays and the attention's few calls, not ~50 launches.

A graph reads fixed buffers: the bucket's hidden state `h` [1, Tb, D], positions [1, Tb] and the
attention's output `o` [1, Tb, H * hd]; the rows past the pass's T tokens are padding, computed
and never read (every piece works per token, so they change no real row). The after-graph writes
the layer's output back into `h`, where the next layer's before-graph reads it; the pass returns
a copy, since another request's pass may run between two of this one's layers (a service
interleaves them at their `Need`s) and reuse the buffers.

`capture` is how a graph is made: `cuda_capture` on a CUDA device, `eager_capture` (the same
sequence run eagerly from the same buffers) where there is none, which is what tests on the CPU
check: no value read from the host, fixed shapes per bucket, captures that disturb nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from droidmesh.shared.model import pieces

if TYPE_CHECKING:
    from droidmesh.shared.model.adapter import ModelAdapter

MIN_KEYS_BUCKET = 256  # the smallest keys bucket a decode pool's graphed step attends over
TOKEN_BUCKETS = (1, 8, 32, 128)  # the new tokens a layer graph is captured for; longer passes run eagerly


class Replay:
    """A captured step: `run()` recomputes `outs` (fixed tensors) from the buffers it was captured over."""

    def __init__(self, run: Callable[[], Any], outs: tuple[torch.Tensor, ...]):
        self.run, self.outs = run, outs


Captured = Callable[[], tuple[torch.Tensor, ...]]  # what a capture records: fixed buffers in, tensors out
Capture = Callable[[Captured], Replay]

def bucket(n: int, most: int, least: int = 1) -> int:
    """The bucket `n` runs in: the next power of two from `least`, at most `most`."""
    size = least
    while size < n:
        size *= 2
    return min(size, most)


def buckets(most: int, least: int = 1) -> list[int]:
    """Every bucket up to `most`: powers of two from `least`, then `most`."""
    out, size = [], least
    while size < most:
        out.append(size)
        size *= 2
    return out + [most]


def cuda_capture() -> Capture:
    """Capture with CUDA graphs, every graph in one memory pool (made at the first capture, on the
    compute thread): two warm-up runs on a side stream (kernels chosen, workspaces allocated),
    then the capture, whose replay recomputes its outputs. Graphs share the pool safely because
    they are replayed one at a time on one stream, and every output stays referenced."""
    mempool: list[Any] = []

    def capture(fn: Captured) -> Replay:
        if not mempool:
            mempool.append(torch.cuda.graph_pool_handle())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool[0]):
            outs = fn()
        return Replay(graph.replay, outs)

    return capture


def eager_capture(fn: Captured) -> Replay:
    """What a capture does, eagerly (tests on the CPU): the same warm-up runs, then a replay that
    recomputes into the same output tensors from the buffers alone."""
    for _ in range(2):
        fn()
    outs = fn()

    def replay() -> None:
        for out, new in zip(outs, fn(), strict=True):
            if out is not new:
                out.copy_(new)

    return Replay(replay, outs)


@dataclasses.dataclass
class _Buffers:
    """One token bucket's fixed buffers."""

    h: torch.Tensor  # [1, Tb, D] the layer's input, then (after-graph) its output
    positions: torch.Tensor  # [1, Tb] long
    o: torch.Tensor  # [1, Tb, H * hd] the attention's output


class LayerGraphs:
    """Short passes of `model` (batch 1, T <= the largest bucket) through captured layer pieces."""

    def __init__(self, model: ModelAdapter, capture: Capture, token_buckets: Sequence[int] = TOKEN_BUCKETS):
        for layer in model.model.model.layers:
            pieces.check(model.config.model_type, layer)
        self.model, self.capture, self.token_buckets = model, capture, tuple(sorted(token_buckets))
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int, str], Replay] = {}  # (token bucket, layer, "before" / "after")

    def covers(self, h: torch.Tensor) -> bool:
        return h.shape[0] == 1 and h.shape[1] <= self.token_buckets[-1]

    def run(self, h: torch.Tensor, start: int, end: int, cache: Any, past: int) -> torch.Tensor:
        """`ModelAdapter.run_layers`, replayed: h [1, T, D] at positions past.. through layers
        start..end-1, each appending its K/V to `cache`. Returns a new tensor E_end [1, T, D]."""
        t = h.shape[1]
        tb = next(b for b in self.token_buckets if b >= t)
        buf = self._buffers(tb)
        buf.h[:, :t].copy_(h)
        buf.positions.copy_(torch.arange(past, past + tb, device=buf.positions.device)[None])
        layers, windows = self.model.model.model.layers, self.model.windows
        for l in range(start, end):
            before = self._graph(tb, l, "before")
            before.run()
            q, k, v = before.outs  # [1, H, Tb, hd], [1, kvH, Tb, hd] x 2
            o = pieces.attend(layers[l], q[:, :, :t], k[:, :, :t], v[:, :, :t], cache, windows[l])  # [1, T, H * hd]
            buf.o[:, :t].copy_(o)
            self._graph(tb, l, "after").run()  # buf.h: the layer's output
        return buf.h[:, :t].clone()

    def warm(self) -> int:
        """Capture every layer's pieces for every token bucket (at start, before any request);
        returns the number of graphs."""
        with torch.inference_mode():
            for tb in self.token_buckets:
                for l in range(self.model.num_layers):
                    self._graph(tb, l, "before")
                    self._graph(tb, l, "after")
        return len(self.graphs)

    def _buffers(self, tb: int) -> _Buffers:
        if tb not in self.buffers:
            m = self.model
            dev, dt, attn = m.device, m.dtype, m.model.model.layers[0].self_attn
            width = m.config.num_attention_heads * attn.head_dim
            self.buffers[tb] = _Buffers(h=torch.zeros(1, tb, m.config.hidden_size, dtype=dt, device=dev),
                                        positions=torch.arange(tb, device=dev)[None],
                                        o=torch.zeros(1, tb, width, dtype=dt, device=dev))
        return self.buffers[tb]

    def _graph(self, tb: int, l: int, piece: str) -> Replay:
        key = (tb, l, piece)
        if key in self.graphs:
            return self.graphs[key]
        buf, layer, model = self._buffers(tb), self.model.model.model.layers[l], self.model
        kind = model.config.model_type

        def before() -> tuple[torch.Tensor, ...]:
            cos, sin = model._rope(buf.h, buf.positions, l)  # each [1, Tb, hd]
            return pieces.before(layer, buf.h, cos, sin)

        def after() -> tuple[torch.Tensor, ...]:
            return (buf.h.copy_(pieces.after(layer, kind, buf.o, buf.h)),)

        if piece == "before":  # reads the buffers, writes none
            self.graphs[key] = self.capture(before)
            return self.graphs[key]
        saved = buf.h.clone()  # the after-graph's warm-up runs write buf.h, where a pass may be under way
        self.graphs[key] = self.capture(after)
        buf.h.copy_(saved)
        return self.graphs[key]
