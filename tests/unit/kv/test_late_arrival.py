"""Layers delivered late by another thread: in random order (the result is exact) and held back
on the engine's progress (recompute overlaps the KV transfer)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from droidmesh.shared.errors import MissingLayerError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import ArrivingSource, CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter
from tests.conftest import ATOL, perturbed_copy

L = 6
HOLD_S = 10.0  # the longest the producer holds the last layer back waiting for the recompute


def _deliver(captured, source: ArrivingSource, order: list[tuple[str, int]], gap_s: float) -> threading.Thread:
    def run() -> None:
        for kind, layer in order:
            time.sleep(gap_s)  # stands in for a transfer; the test asserts results, not timing
            if kind == "e":
                source.put_e(layer, captured.e[layer])
            else:
                source.put_kv(captured.kv[layer])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_random_order_equals_up_front(receiver, prompt, seed):
    """Random-order background delivery gives exactly the all-up-front result."""
    ctx, q = prompt
    sender = perturbed_copy(receiver, range(1, 3))
    plan = ReusePlan.recompute_groups([(1, 3), (4, 5)])
    captured = capture_prefill(sender, ctx, e_layers=plan.e_layers)
    up_front = prefill(receiver, ctx + q, plan, CapturedSource(captured))
    order = [("e", s) for s in plan.e_layers] + [("kv", l) for l in plan.reused_layers(L)]
    random.Random(seed).shuffle(order)
    source = ArrivingSource(captured.token_ids, captured.fingerprint)
    thread = _deliver(captured, source, order, gap_s=0.002)
    late = prefill(receiver, ctx + q, plan, source, timeout_s=30)
    thread.join()
    assert float((late.logits - up_front.logits).abs().max()) <= ATOL


class _Watched(ModelAdapter):
    """The receiver, logging each context pass (`past == 0`: a recompute group) as it starts."""

    log: list[str]
    recomputing: threading.Event

    def run_layers(self, h: torch.Tensor, start: int, end: int, cache: Any, past: int) -> torch.Tensor:
        if past == 0:
            self.log.append(f"recompute {start}..{end}")
            self.recomputing.set()
        return super().run_layers(h, start, end, cache, past)


def test_recompute_starts_before_the_last_reused_kv_arrives(receiver, prompt):
    """With E first, the group is recomputed while the last reused KV layer is still in flight.

    The producer holds the last reused layer back until the engine has started recomputing (or
    `HOLD_S` passes, which only an engine that waits for all KV first would need): the order of
    the log is then fixed by the engine's behaviour, not by thread timing.
    """
    ctx, q = prompt
    plan = ReusePlan.recompute(1, 3)
    captured = capture_prefill(receiver, ctx, e_layers=plan.e_layers)
    up_front = prefill(receiver, ctx + q, plan, CapturedSource(captured))
    watched = _Watched(model=receiver.model, tokenizer=None, name=receiver.name)
    watched.log, watched.recomputing = [], threading.Event()
    source = ArrivingSource(captured.token_ids, captured.fingerprint)
    *early, last = plan.reused_layers(L)

    def produce() -> None:
        watched.log.append("delivering e1")
        source.put_e(1, captured.e[1])
        for layer in early:
            watched.log.append(f"delivering kv{layer}")
            source.put_kv(captured.kv[layer])
        watched.recomputing.wait(HOLD_S)
        watched.log.append(f"delivering kv{last}")
        source.put_kv(captured.kv[last])

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    res = prefill(watched, ctx + q, plan, source, timeout_s=30)
    thread.join()
    assert watched.log.index("recompute 1..3") < watched.log.index(f"delivering kv{last}")
    assert res.stages["recompute_done"] < res.stages["kv_last_ready"]
    assert float((res.logits - up_front.logits).abs().max()) <= ATOL


def test_missing_layer_times_out_with_specific_error(receiver, prompt):
    """A reused layer that never arrives raises MissingLayerError at the deadline."""
    ctx, q = prompt
    captured = capture_prefill(receiver, ctx)
    source = ArrivingSource(captured.token_ids, captured.fingerprint)
    for layer in range(L - 1):  # the last layer never comes
        source.put_kv(captured.kv[layer])
    with pytest.raises(MissingLayerError, match=f"layer {L - 1}"):
        prefill(receiver, ctx + q, ReusePlan.full_reuse(), source, timeout_s=0.2)


def test_source_failure_aborts_waits(receiver, prompt):
    """A transport failure reported to the source ends the engine's wait at once."""
    ctx, q = prompt
    captured = capture_prefill(receiver, ctx, e_layers=[2])
    source = ArrivingSource(captured.token_ids, captured.fingerprint)
    source.fail(ConnectionResetError("sender died"))
    with pytest.raises(MissingLayerError, match="sender died"):
        prefill(receiver, ctx + q, ReusePlan.recompute(2, 4), source, timeout_s=30)


def test_halves_in_either_order_make_one_layer(receiver, prompt):
    """K and V delivered separately, V first, become that layer's KV block exactly once both are in."""
    ctx, _ = prompt
    captured = capture_prefill(receiver, ctx)
    source = ArrivingSource(captured.token_ids, captured.fingerprint)
    block = captured.kv[3]
    source.put("V", 3, block.v)
    with pytest.raises(MissingLayerError):
        source.kv(3, deadline=time.monotonic() + 0.05)
    source.put("K", 3, block.k)
    got = source.kv(3, deadline=time.monotonic() + 1)
    assert torch.equal(got.k, block.k) and torch.equal(got.v, block.v)  # bitwise: the delivered tensors themselves
