"""The engine's tensors are born on the model's device, and delivered tensors are checked for it.

Runs without a GPU: torch's `meta` device has shapes and dtypes but no data, so a model moved
there runs every mode shape-for-shape, and any tensor the engine built on an implicit CPU device
would meet a meta tensor and fail (or show up on the CPU).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from droidmesh.shared.errors import CacheLayoutError
from droidmesh.shared.kv.blend import blend_visibility, token_deviation
from droidmesh.shared.kv.blocks import KVBlock, check_kv, check_tensor
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def meta_receiver(receiver: ModelAdapter) -> ModelAdapter:
    return ModelAdapter(model=copy.deepcopy(receiver.model).to(META), tokenizer=None, name="meta-receiver")


@pytest.mark.parametrize(
    "plan",
    [ReusePlan.full_prefill(), ReusePlan.full_reuse(), ReusePlan.recompute_groups([(0, 1), (3, 5)]),
     ReusePlan.cacheblend(0.25), ReusePlan.swap([2])],
    ids=lambda p: p.label(),
)
def test_every_mode_runs_on_the_models_device(meta_receiver, prompt, plan):
    """Capture and prefill on a meta-device model keep every tensor there; logits are float32."""
    ctx, q = prompt
    captured = capture_prefill(meta_receiver, ctx, e_layers=plan.e_layers)
    assert {b.k.device for b in captured.kv} | {e.device for e in captured.e.values()} <= {META}
    res = prefill(meta_receiver, ctx + q, plan, CapturedSource(captured))
    assert res.logits.device == META and res.logits.dtype == torch.float32
    assert tuple(res.logits.shape) == (1, 97)  # the last prompt token's only


def test_blend_visibility_follows_its_input_device():
    """The CacheBlend mask is built on the device of the picked positions."""
    picked = torch.tensor([1, 4, 6], device=META)
    allowed = blend_visibility(picked, 8)
    assert allowed.device == META and tuple(allowed.shape) == (1, 1, 3, 8 + 3) and allowed.dtype == torch.bool


def test_blend_visibility_values_on_cpu():
    """Picked token p sees unpicked sender keys <= p and fresh keys of picked tokens <= p."""
    allowed = blend_visibility(torch.tensor([1, 3]), 4)[0, 0]  # [2, 6]
    expected = torch.tensor([[True, False, False, False, True, False], [True, False, True, False, True, True]])
    assert torch.equal(allowed, expected)  # bitwise: a boolean mask: no rounding


def test_token_deviation_follows_its_input_device():
    """Per-token deviation of meta K/V is a float32 [T] on meta."""
    k = torch.empty(1, 2, 5, 8, dtype=torch.bfloat16, device=META)
    dev = token_deviation(k, k, k, k)
    assert dev.device == META and tuple(dev.shape) == (5,) and dev.dtype == torch.float32


def test_check_tensor_refuses_another_device():
    """A tensor of the right shape and dtype on another device is a CacheLayoutError naming both."""
    t = torch.empty(1, 3, 4, device=META)
    check_tensor("E of layer 2", t, (1, 3, 4), torch.float32, META)
    with pytest.raises(CacheLayoutError, match="E of layer 2: device meta, expected cpu"):
        check_tensor("E of layer 2", t, (1, 3, 4), torch.float32, CPU)


def test_check_kv_refuses_another_device():
    """A KV block whose V is on another device is refused, naming the half."""
    k = torch.zeros(1, 2, 4, 8)
    with pytest.raises(CacheLayoutError, match="layer 1 V: device meta, expected cpu"):
        check_kv(KVBlock(1, k, torch.empty_like(k, device=META)), 1, (1, 2, 4, 8), torch.float32, CPU)


@pytest.mark.parametrize("plan", [ReusePlan.full_reuse(), ReusePlan.recompute(2, 4), ReusePlan.cacheblend(0.5)],
                         ids=lambda p: p.label())
def test_engine_refuses_tensors_on_another_device(receiver, prompt, plan):
    """A sender cache delivered on another device is a CacheLayoutError (the caller falls back)."""
    ctx, q = prompt
    cap = capture_prefill(receiver, ctx, e_layers=plan.e_layers)
    moved = dataclasses.replace(
        cap,
        kv=tuple(KVBlock(b.layer, b.k.to(META), b.v.to(META)) for b in cap.kv),
        e={l: e.to(META) for l, e in cap.e.items()},
    )
    with pytest.raises(CacheLayoutError, match="device meta, expected cpu"):
        prefill(receiver, ctx + q, plan, CapturedSource(moved))
