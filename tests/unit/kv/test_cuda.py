"""The engine on a CUDA device against the same model's full prefill on that device.

Skipped where CUDA is absent. Tolerances, max-abs-diff of logits (|logit| < 1 for these tiny
random models): float32 1e-3, ten times the CPU's, because CUDA kernels reduce in an order that
depends on the sequence split (suffix alone vs whole prompt); bfloat16 3e-2, a few bf16 ulps at
that scale (the CPU shows up to 3e-3 for CacheBlend in bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch

from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter, load_model, random_model
from tests.conftest import FAMILIES, perturbed_copy, reference_greedy, reference_logits

pytestmark = pytest.mark.gpu

L = 6
CUDA_ATOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
PLANS = [ReusePlan.full_reuse(), ReusePlan.recompute(1, 3), ReusePlan.recompute_groups([(0, 1), (3, 5)]),
         ReusePlan.cacheblend(0.25), ReusePlan.swap([2])]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_receiver(family: str, request: pytest.FixtureRequest) -> ModelAdapter:
    return random_model(family, seed=0, device="cuda", dtype=request.param, name="receiver", **FAMILIES[family])


def _on_cuda(model: ModelAdapter) -> ModelAdapter:
    """A copy of a CPU model on the GPU (same weights, same dtype)."""
    return ModelAdapter(model=copy.deepcopy(model.model).to("cuda"), tokenizer=None, name=model.name)


def _suffix_diff(logits: torch.Tensor, ref: torch.Tensor, question: list[int]) -> float:
    return float((logits[-len(question):] - ref[-len(question):]).abs().max())


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_self_reuse_on_cuda_matches_full_prefill(cuda_receiver, prompt, plan):
    """With sender == receiver on CUDA, every mode gives the receiver's own full-prefill logits."""
    ctx, q = prompt
    src = CapturedSource(capture_prefill(cuda_receiver, ctx, e_layers=plan.e_layers))
    res = prefill(cuda_receiver, ctx + q, plan, src, logits_for=len(q))
    assert res.logits.device.type == "cuda" and res.logits.dtype == torch.float32
    ref = reference_logits(cuda_receiver, ctx + q)
    assert _suffix_diff(res.logits, ref, q) <= CUDA_ATOL[cuda_receiver.dtype]


def test_cacheblend_full_ratio_on_cuda_recovers_a_different_sender(receiver, prompt):
    """CacheBlend recomputing every token from a foreign sender equals full prefill on CUDA (float32)."""
    ctx, q = prompt
    sender, cuda_receiver = _on_cuda(perturbed_copy(receiver, range(L))), _on_cuda(receiver)
    src = CapturedSource(capture_prefill(sender, ctx))
    ref = reference_logits(cuda_receiver, ctx + q)
    res = prefill(cuda_receiver, ctx + q, ReusePlan.cacheblend(1.0), src, logits_for=len(q))
    assert _suffix_diff(res.logits, ref, q) <= CUDA_ATOL[torch.float32]
    gen = generate(cuda_receiver, ctx + q, ReusePlan.cacheblend(1.0), src, max_new_tokens=6)
    assert gen.tokens == reference_greedy(cuda_receiver, ctx + q, 6)


def test_capture_on_cuda_matches_cpu_capture(receiver, prompt):
    """Capture on CUDA keeps KV and E on the device, equal to the CPU capture of the same weights."""
    ctx, _ = prompt
    on_cuda = _on_cuda(receiver)
    got = capture_prefill(on_cuda, ctx, e_layers=[0, 2])
    want = capture_prefill(receiver, ctx, e_layers=[0, 2])
    tensors = [t for b in got.kv for t in (b.k, b.v)] + list(got.e.values())
    assert all(t.device == on_cuda.device for t in tensors)
    for g, w in zip(got.kv, want.kv, strict=True):
        assert float((g.k.cpu() - w.k).abs().max()) <= CUDA_ATOL[torch.float32]
        assert float((g.v.cpu() - w.v).abs().max()) <= CUDA_ATOL[torch.float32]
    assert float((got.e[2].cpu() - want.e[2]).abs().max()) <= CUDA_ATOL[torch.float32]


def test_load_model_on_cuda_defaults_to_bfloat16(tiny_pair):
    """A checkpoint loaded with device='cuda' sits on the GPU in bfloat16 unless a dtype is given."""
    model = load_model(tiny_pair[1], device="cuda")
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    assert load_model(tiny_pair[1], device="cuda", dtype="float32").dtype == torch.float32
