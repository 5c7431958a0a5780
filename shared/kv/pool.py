"""A decode pool: a decode batch's K/V in storage fixed for the pool's life (`KVPool`).

The ragged batch (`ModelAdapter.decode`) reads each request's own cache: exact and copy-free, but
a step is a few calls per row and layer whose shapes change every step, and on a GPU the host
issuing them is the bottleneck (about 1,700 launches for a step of one sequence through 32
layers, each a few microseconds of kernel). A pool keeps K/V per layer as

    K, V  [slots, kv_heads, tokens, head_dim]

and lends slot s to a request while it decodes (`hf_cache.lend`: its cache's layers point at the
slot, what it held copied in once). A step over the first B slots and the first `keys` tokens is
then one set of calls whose shapes depend on (B, keys) only, with the rows' token ids and
positions in fixed device buffers (`ids`, `positions`): `ModelAdapter.decode_slots`. So it can be
captured once per (B, keys) bucket and replayed (`StepGraphs`, CUDA graphs), and on any device it
runs one attention call per layer for the whole batch. Rows of a bucket that hold no stepping
request feed token 0 at the scratch position `tokens - 1` of their slot, a place no request is
given (a request is lent a slot only if its whole answer fits below it), so the warm-up runs of a
capture can write there while other requests hold their slots.

When a request ends, its cache gets storage of its own back with every token it holds
(`hf_cache.reclaim`): a held context read after decoding (`capture.captured_of`) sees them. A
request that does not fit (a longer answer than the slots hold, a cache that is not write-once)
decodes beside the pool, on the ragged path, in the same step.

Memory: 2 * layers * slots * tokens * kv_heads * head_dim * itemsize, allocated at the first
step (or `warm`) on the compute thread; on a CUDA device it must fit in the free memory then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model import hf_cache
from droidmesh.shared.model.graphs import MIN_KEYS_BUCKET, Capture, Replay, bucket, buckets

if TYPE_CHECKING:
    from droidmesh.shared.kv.decode import Decoding
    from droidmesh.shared.model.adapter import ModelAdapter

class KVPool:
    """`slots` decode places of `tokens` tokens each (the last one scratch) for `model`'s K/V."""

    def __init__(self, model: ModelAdapter, slots: int, tokens: int, capture: Capture | None = None):
        """`capture`: how a (B, keys) bucket's step is captured for replay (`cuda_capture`); None:
        every step runs eagerly at its exact (B, keys)."""
        if slots < 1 or tokens < 2:
            raise ConfigError(f"a decode pool needs >= 1 slot and >= 2 tokens, got {slots} and {tokens}")
        self.model, self.slots, self.tokens, self.capture = model, slots, tokens, capture
        self.k: list[torch.Tensor] = []  # per layer [slots, kvh, tokens, hd]; allocated by `_allocate`
        self.v: list[torch.Tensor] = []
        self.held: list[Decoding | None] = [None] * slots  # slot -> the request lent it
        self.graphs: dict[tuple[int, int], Replay] = {}  # (B bucket, keys bucket) -> its captured step

    @property
    def nbytes(self) -> int:
        fp = self.model.fingerprint
        item = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * self.model.num_layers * self.slots * self.tokens * fp.num_kv_heads * fp.head_dim * item

    def _allocate(self) -> None:
        if self.k:
            return
        dev, fp = self.model.device, self.model.fingerprint
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            if self.nbytes > free:
                raise ConfigError(f"a decode pool of {self.slots} x {self.tokens} tokens needs {self.nbytes / 2**30:.1f} "
                                  f"GiB; {free / 2**30:.1f} GiB free on {dev}: fewer tokens or a smaller max_batch")
        shape = (self.slots, fp.num_kv_heads, self.tokens, fp.head_dim)
        # zeros, not garbage: a masked key still meets a zero probability in the weighted sum, and 0 * NaN is NaN
        self.k = [torch.zeros(shape, dtype=self.model.dtype, device=dev) for _ in range(self.model.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.model.dtype, device=dev) for _ in range(self.model.num_layers)]
        self.ids = torch.zeros(self.slots, dtype=torch.long, device=dev)  # [slots] each row's token this step
        self.positions = torch.full((self.slots,), self.scratch, dtype=torch.long, device=dev)  # [slots]
        self.rows = torch.arange(self.slots, device=dev)  # [slots]

    @property
    def scratch(self) -> int:
        """The position every slot keeps for writes of rows that hold no stepping request."""
        return self.tokens - 1

    # -- lending -----------------------------------------------------------------------------
    def fits(self, d: Decoding) -> bool:
        """Whether `d`'s cache and every token it may still feed fit below a slot's scratch."""
        return d.past + d.max_new_tokens - len(d.tokens) <= self.scratch and hf_cache.lendable(d.cache)

    def admit(self, d: Decoding) -> bool:
        """Lend `d` the lowest free slot (its cache copied in) if it fits and one is free."""
        if d in self.held:
            return True
        if not self.fits(d) or None not in self.held:
            return False
        self._allocate()
        s = self.held.index(None)
        hf_cache.lend(d.cache, [k[s:s + 1] for k in self.k], [v[s:s + 1] for v in self.v])  # each [1, kvh, tokens, hd]
        self.held[s] = d
        return True

    def release(self, rows: Sequence[Decoding], every: bool = False) -> None:
        """Every finished row of `rows` (`every`: every row) that holds a slot gets its cache back,
        holding its `past` tokens, and the slot is freed."""
        for d in rows:
            if (d.done or every) and d in self.held:
                hf_cache.reclaim(d.cache, d.past)
                self.held[self.held.index(d)] = None

    # -- stepping ----------------------------------------------------------------------------
    def step(self, rows: Sequence[Decoding]) -> torch.Tensor:
        """One decode step of `rows` (each holding a slot): logits [len(rows), vocab], in order."""
        slots = [self.held.index(d) for d in rows]
        b = max(slots) + 1
        keys = max(d.past for d in rows) + 1  # every row's new token lands below this
        if self.capture is not None:
            b, keys = bucket(b, self.slots), bucket(keys, self.tokens, MIN_KEYS_BUCKET)
        ids, positions = [0] * b, [self.scratch] * b
        for s, d in zip(slots, rows, strict=True):
            ids[s], positions[s] = d.tokens[-1], d.past
        self.ids[:b].copy_(torch.tensor(ids))  # one host -> device copy each
        self.positions[:b].copy_(torch.tensor(positions))
        logits = self._run(b, keys)  # [b, vocab]
        return logits[slots]  # [len(rows), vocab]: a copy, the next step may overwrite `logits`

    def _run(self, b: int, keys: int) -> torch.Tensor:
        if self.capture is None:
            return self._forward(b, keys)
        replay = self.graphs.get((b, keys))
        if replay is None:
            replay = self.graphs[(b, keys)] = self._capture(b, keys)
        replay.run()
        return replay.outs[0]

    def _forward(self, b: int, keys: int) -> torch.Tensor:
        """The step over the first `b` slots and `keys` tokens, from the buffers alone."""
        step = hf_cache.SlotsStep(self.k, self.v, self.rows[:b], self.positions[:b], keys)
        return self.model.decode_slots(self.ids[:b], self.positions[:b], step)

    def _capture(self, b: int, keys: int) -> Replay:
        """Bucket (b, keys)'s step captured; its warm-up runs write only at scratch positions."""
        assert self.capture is not None
        ids, positions = self.ids[:b].clone(), self.positions[:b].clone()
        self.ids[:b].zero_()
        self.positions[:b].fill_(self.scratch)
        replay = self.capture(lambda: (self._forward(b, keys),))
        self.ids[:b].copy_(ids)  # the step asked for goes on from the buffers as they were
        self.positions[:b].copy_(positions)
        return replay

    def warm(self, batches: Sequence[int] | None = None, keys: Sequence[int] | None = None) -> int:
        """Capture the step of every (B, keys) bucket up front (at start, so no request waits for a
        capture); returns how many were captured. Without `capture`, only allocates."""
        with torch.inference_mode():
            self._allocate()
            if self.capture is None:
                return 0
            for b in batches or buckets(self.slots):
                for k in keys or buckets(self.tokens, MIN_KEYS_BUCKET):
                    key = (bucket(b, self.slots), bucket(k, self.tokens, MIN_KEYS_BUCKET))
                    if key not in self.graphs:
                        self.graphs[key] = self._capture(*key)
        return len(self.graphs)
