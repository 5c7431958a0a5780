"""int8 / int4 quantization (shared/kv/quant.py): documented error bounds, exact sizes, exact
packing, and bad input refused before the output is written."""

from __future__ import annotations

import pytest
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv import quant
from droidmesh.shared.kv.capture import capture_prefill

# Unit roundoff of each output dtype (half an ulp, relative) and its smallest normal: the
# rounding of x_hat to the dtype that the documented bounds add to scale / 2.
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
F32 = 2.0**-22  # float32 rounding of the quantizer's own arithmetic, relative to |x|
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = {"K": (1, 3, 37, 16), "V": (1, 3, 37, 16), "E": (1, 37, 48)}


def _sample(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random KV / E with a few outlier channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPES[kind], generator=g)
    x[..., 3] *= 20  # an outlier channel
    return x.to(dtype)


def _int8_bound(x: torch.Tensor, xhat: torch.Tensor, kind: str) -> torch.Tensor:
    """scale / 2 + float32 and output-dtype rounding, per element."""
    xf = x.float()
    view = quant.int8_view(tuple(x.shape), kind)
    scale = xf.reshape(view).abs().amax(dim=quant.int8_axis(kind, len(view)), keepdim=True) / 127
    scale = scale.expand(view).reshape(x.shape)  # [shape]: each value's own slice's scale
    return scale / 2 + F32 * xf.abs() + U[x.dtype] * xhat.float().abs() + torch.finfo(x.dtype).smallest_normal


def _int4_bound(x: torch.Tensor, xhat: torch.Tensor, group: int) -> torch.Tensor:
    xg = x.float().reshape(-1, group)  # [n_groups, group]
    lo, hi = xg.amin(1, keepdim=True), xg.amax(1, keepdim=True)  # [n_groups, 1]
    bound = (hi - lo) / 30 + 4 * F32 * torch.maximum(lo.abs(), hi.abs()) + U[x.dtype] * xhat.float().reshape(-1, group).abs()
    return (bound + torch.finfo(x.dtype).smallest_normal).reshape(x.shape)


def _int8_round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    out = torch.empty_like(x)
    quant.int8_dequantize(quant.int8_quantize(x, kind), kind, out)
    return out


def _int4_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    out = torch.empty_like(x)
    quant.int4_dequantize(quant.int4_quantize(x, group), group, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["K", "V", "E"])
def test_int8_round_trip_is_within_the_documented_bound(kind, dtype):
    """Random tensors with an outlier channel: |x - x_hat| <= scale / 2 + rounding, everywhere."""
    x = _sample(kind, dtype)
    xhat = _int8_round_trip(x, kind)
    assert xhat.dtype == dtype and xhat.shape == x.shape
    assert bool(((x.float() - xhat.float()).abs() <= _int8_bound(x, xhat, kind)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("kind", ["K", "E"])
def test_int4_round_trip_is_within_the_documented_bound(kind, group, dtype):
    """Random tensors, several group sizes: |x - x_hat| <= (max - min) / 30 + rounding."""
    x = _sample(kind, dtype)
    xhat = _int4_round_trip(x, group)
    assert bool(((x.float() - xhat.float()).abs() <= _int4_bound(x, xhat, group)).all())


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    """The reason K is quantized per channel: with an outlier channel, per-token scales lose the
    ordinary channels; per-channel scales keep them (mean error several times lower)."""
    x = _sample("K", torch.float32)
    err_channel = (_int8_round_trip(x, "K") - x).abs()[..., :3].mean()
    err_token = (_int8_round_trip(x, "V") - x).abs()[..., :3].mean()
    assert err_channel * 4 < err_token


def test_round_trip_on_real_kv_and_e_is_within_the_bound(receiver, prompt):
    """Every layer's K and V, and E, captured from a zoo-shaped model: within both codecs' bounds."""
    ctx, _ = prompt
    cap = capture_prefill(receiver, ctx, e_layers=[0, 3])
    tensors = [(b.k, "K") for b in cap.kv] + [(b.v, "V") for b in cap.kv] + [(e, "E") for e in cap.e.values()]
    for x, kind in tensors:
        xhat = _int8_round_trip(x, kind)
        assert bool(((x - xhat).abs() <= _int8_bound(x, xhat, kind)).all()), kind
        for group in (8, x.shape[-1]):
            xhat = _int4_round_trip(x, group)
            assert bool(((x - xhat).abs() <= _int4_bound(x, xhat, group)).all()), (kind, group)


@pytest.mark.parametrize("shape", [(1, 2, 5, 3), (1, 1, 1, 1), (1, 3, 7, 8), (1, 4, 0, 8), (1, 33, 10), (1, 5, 96)])
def test_payload_sizes_are_exact(shape):
    """Odd and empty shapes included: the payload is exactly the layout's size, scales aligned."""
    x = torch.randn(shape)
    e_groups = shape[-1] // 32 if shape[-1] % 32 == 0 else 1  # E: per token and 32 dims where 32 divides D
    for kind in ("K", "V", "E") if len(shape) == 4 else ("E",):
        scale_shape = shape[:-2] + (1, shape[-1]) if kind == "K" else shape[:-1] + (e_groups if kind == "E" else 1,)
        n, scales = x.numel(), torch.Size(scale_shape).numel()
        assert quant.int8_quantize(x, kind).numel() == quant.int8_nbytes(shape, kind) == (n + 3) // 4 * 4 + 4 * scales
    for group in (1, shape[-1]):
        assert quant.int4_quantize(x, group).numel() == quant.int4_nbytes(shape, group) == \
            ((x.numel() + 1) // 2 + 3) // 4 * 4 + 8 * (x.numel() // group)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_is_exact_on_representable_values(dtype):
    """Groups whose values are lo + k * scale (k in 0..15, both ends present) decode bit-exact."""
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 16, (1, 2, 6, 16), generator=g)
    k[..., 0], k[..., 1] = 0, 15  # every group of 8 spans 0..15 ...
    k[..., 8], k[..., 9] = 15, 0  # ... including the second one of each row
    lo = torch.randint(-8, 8, (1, 2, 6, 1), generator=g).repeat_interleave(16, dim=-1)  # [1, 2, 6, 16]
    x = (lo + k * 0.25).to(dtype)  # scale 0.25 per group: exact in every dtype
    assert torch.equal(_int4_round_trip(x, 8), x)  # bitwise: values the codec represents exactly


def test_int4_packs_two_values_per_byte_low_nibble_first():
    """The documented layout, byte for byte: nibbles, padding, then scales and minima as float32."""
    x = torch.tensor([[0.0, 1.0, 2.0, 15.0, 4.0, 5.0, 6.0, 7.0]])  # one group of 8: lo 0, scale 1
    payload = quant.int4_quantize(x, 8)
    assert payload[:4].tolist() == [0x10, 0xF2, 0x54, 0x76]
    assert payload[4:8].view(torch.float32).tolist() == [1.0] and payload[8:12].view(torch.float32).tolist() == [0.0]
    odd = quant.int4_quantize(torch.tensor([[3.0, 0.0, 15.0]]), 3)  # 3 values: the last high nibble pads
    assert odd[:4].tolist() == [0x03, 0x0F, 0, 0] and odd.numel() == 4 + 8


def test_int8_is_exact_on_representable_values():
    """Per-token slices whose max |x| is 127 * scale and values q * scale decode bit-exact."""
    q = torch.randint(-127, 128, (1, 2, 5, 8), generator=torch.Generator().manual_seed(2)).float()
    q[..., 0] = 127
    x = q * torch.tensor([0.5, 2.0, 0.125, 1.0, 4.0]).view(1, 1, 5, 1)  # power-of-two scales per token
    assert torch.equal(_int8_round_trip(x, "V"), x)  # bitwise: values the codec represents exactly
    assert quant.int8_quantize(x, "V")[:4].view(torch.int8).tolist() == q.flatten()[:4].to(torch.int8).tolist()


def test_zero_and_constant_slices_decode_exactly():
    """A zero scale (all-zero channel, constant group) is no division by zero: exact, finite output."""
    x = torch.zeros(1, 2, 4, 8)
    x[0, 1] = 3.5
    # bitwise: zeros and constants decode exactly
    assert torch.equal(_int8_round_trip(x, "K"), x) and torch.equal(_int8_round_trip(x, "V"), x)
    assert torch.equal(_int4_round_trip(x, 4), x)  # bitwise: zeros and constants decode exactly


def test_a_strided_prefix_encodes_like_its_contiguous_copy():
    """The sender encodes a token prefix (a non-contiguous view) as it would the copied tensor."""
    x = torch.randn(1, 2, 9, 8)
    prefix = x.narrow(2, 0, 5)  # [1, 2, 5, 8], not contiguous
    # bitwise: the same quantizer on the same values; its scales come from maxima and minima, exact in any order
    assert torch.equal(quant.int8_quantize(prefix, "K"), quant.int8_quantize(prefix.contiguous(), "K"))
    # bitwise: the same quantizer on the same values; its scales come from maxima and minima, exact in any order
    assert torch.equal(quant.int4_quantize(prefix, 4), quant.int4_quantize(prefix.contiguous(), 4))


def test_encoding_does_not_modify_the_stored_tensor():
    """Quantizers work on copies: the stored (float32, bf16) tensors are unchanged."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, 2, 5, 8).to(dtype)
        before = x.clone()
        quant.int8_quantize(x, "K"), quant.int8_quantize(x, "V"), quant.int4_quantize(x, 4)
        assert torch.equal(x, before)  # bitwise: the stored tensor, untouched


@pytest.mark.parametrize("group", [0, -4, 3, 1 << 40, 16, True, 4.0, "4"])
def test_groups_that_do_not_fit_the_layout_are_refused(group):
    """A group that is not an int in [1, last dim] dividing the last dim (8) is an IntegrityError."""
    with pytest.raises(IntegrityError, match="int4: group"):
        quant.check_group((1, 2, 5, 8), group)
    with pytest.raises(IntegrityError):
        quant.int4_nbytes((1, 2, 5, 8), group)


def test_unknown_kind_and_non_float_tensors_are_refused():
    """A kind outside K / V / E, a 1-D K and an integer tensor are IntegrityErrors."""
    with pytest.raises(IntegrityError, match="kind 'Q'"):
        quant.int8_nbytes((1, 2, 3, 4), "Q")
    with pytest.raises(IntegrityError, match="at least 2 dims"):
        quant.int8_quantize(torch.randn(4), "K")
    with pytest.raises(IntegrityError, match="floating-point"):
        quant.int8_quantize(torch.ones(1, 2, 3, 4, dtype=torch.int32), "V")


def test_non_finite_input_is_refused_by_the_encoder():
    """NaN or inf in the stored tensor is refused, not shipped as NaN scales."""
    x = torch.randn(1, 2, 5, 8)
    x[0, 1, 2, 3] = float("nan")
    with pytest.raises(IntegrityError, match="NaN or inf"):
        quant.int8_quantize(x, "K")
    x[0, 1, 2, 3] = float("inf")
    with pytest.raises(IntegrityError, match="NaN or inf"):
        quant.int4_quantize(x, 4)


def _sentinel(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, 7.0, dtype=dtype)


@pytest.mark.parametrize("delta", [-1, 1, -4, 4])
def test_a_payload_of_another_size_is_refused_and_out_untouched(delta):
    """One byte (or word) short or long: IntegrityError, the output buffer still holds what it held."""
    x = torch.randn(1, 2, 5, 8)
    for payload, decode in ((quant.int8_quantize(x, "V"), lambda p, o: quant.int8_dequantize(p, "V", o)),
                            (quant.int4_quantize(x, 4), lambda p, o: quant.int4_dequantize(p, 4, o))):
        wrong = torch.cat([payload, torch.zeros(delta, dtype=torch.uint8)]) if delta > 0 else payload[:delta]
        out = _sentinel(x.shape)
        with pytest.raises(IntegrityError, match="payload of"):
            decode(wrong, out)
        assert torch.equal(out, _sentinel(x.shape))  # bitwise: the buffer nothing wrote


@pytest.mark.parametrize("scale", [float("nan"), -1.0, float("inf")])
def test_scales_that_would_decode_to_nan_or_inf_are_refused_before_writing(scale):
    """A NaN, negative or infinite scale in a (checksum-valid) payload: IntegrityError, out untouched."""
    x = torch.randn(1, 2, 5, 8)
    p8, p4 = quant.int8_quantize(x, "V"), quant.int4_quantize(x, 4)
    p8[80:84].view(torch.float32)[0] = scale  # the first per-token scale (after 80 int8 values)
    p4[40:44].view(torch.float32)[0] = scale  # the first group's scale (after 40 packed bytes)
    for decode in (lambda o: quant.int8_dequantize(p8, "V", o), lambda o: quant.int4_dequantize(p4, 4, o)):
        out = _sentinel(x.shape)
        with pytest.raises(IntegrityError, match="scales|range"):
            decode(out)
        assert torch.equal(out, _sentinel(x.shape))  # bitwise: the buffer nothing wrote


def test_values_beyond_the_output_dtypes_range_are_refused():
    """A float32 scale that is finite but decodes beyond float16's range (or a huge int4 minimum)
    is refused for a float16 buffer, accepted for a float32 one."""
    x = torch.full((1, 2, 5, 8), 1000.0)
    out16 = _sentinel(x.shape, torch.float16)
    with pytest.raises(IntegrityError, match="beyond torch.float16's range"):
        quant.int8_dequantize(quant.int8_quantize(x * 100, "V"), "V", out16)
    with pytest.raises(IntegrityError, match="beyond torch.float16's range"):
        quant.int4_dequantize(quant.int4_quantize(x * 100, 4), 4, out16)
    assert torch.equal(out16, _sentinel(x.shape, torch.float16))  # bitwise: the buffer nothing wrote
    out32 = torch.empty(x.shape)
    quant.int4_dequantize(quant.int4_quantize(x * 100, 4), 4, out32)
    assert torch.equal(out32, x * 100)  # bitwise: a constant group decodes to its minimum


def test_a_misaligned_payload_view_still_decodes():
    """A payload viewed at an odd offset (scales not 4-byte aligned in memory) decodes the same."""
    x = torch.randn(1, 2, 5, 8)
    payload = quant.int8_quantize(x, "K")
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])[1:]  # storage offset 1
    a, b = torch.empty_like(x), torch.empty_like(x)
    quant.int8_dequantize(payload, "K", a)
    quant.int8_dequantize(shifted, "K", b)
    assert torch.equal(a, b)  # bitwise: the same payload bytes at another offset


def test_a_massive_channel_of_e_does_not_coarsen_the_rest_of_its_token():
    """A hidden state's massive channel (1000x the rest, as real models have) costs precision only
    in its own 32 dims: the other dims of the same token decode within their own slice's scale."""
    x = torch.randn(1, 6, 96)  # [1, T, D]: three groups of 32 dims
    x[..., 3] = 1000.0
    out = _int8_round_trip(x, "E")
    rest = (out - x)[..., 32:].abs()  # [1, T, 64]: the groups without the massive channel
    assert float(rest.max()) <= float(x[..., 32:].abs().max()) / 127  # per token it would be ~1000 / 254
    assert float((out - x)[..., 3].abs().max()) <= 1000.0 / 254 + 1e-3


@pytest.mark.parametrize("tokens", [1, 7, 64, 100])
def test_int4_k_groups_each_channels_tokens_so_an_outlier_channel_keeps_to_itself(tokens):
    """K per channel over groups of 32 tokens (the last one shorter): every value decodes within
    its own channel-and-token-group's range / 30, so a channel 100x the others (keys have them)
    coarsens no other channel; the payload is the layout's size, scales for ceil(T / 32) groups."""
    x = torch.randn(1, 2, tokens, 16)  # [1, kvh, T, hd]
    x[..., 5] *= 100
    payload = quant.int4_quantize(x, 32, "K")
    groups = 2 * 16 * -(-tokens // 32)
    assert payload.numel() == quant.int4_nbytes(tuple(x.shape), 32, "K") == ((x.numel() + 1) // 2 + 3) // 4 * 4 + 8 * groups
    out = torch.empty_like(x)
    quant.int4_dequantize(payload, 32, out, "K")
    err = (out - x).abs().transpose(-1, -2)  # [1, kvh, hd, T]
    xt = x.transpose(-1, -2)
    for s in range(0, tokens, 32):
        seg = xt[..., s:s + 32]
        bound = (seg.amax(-1, keepdim=True) - seg.amin(-1, keepdim=True)) / 30 + 1e-5 * seg.abs().amax(-1, keepdim=True)
        assert bool((err[..., s:s + 32] <= bound + 1e-6).all())
    assert float(err[..., [c for c in range(16) if c != 5], :].max()) < 0.5  # per token, 100x channel 5's range / 30 ~ 10


def test_int4_k_refuses_a_token_group_out_of_range_and_a_header_of_another_kind_is_another_size():
    x = torch.randn(1, 2, 40, 8)
    with pytest.raises(IntegrityError, match="a K group of 2000 tokens"):
        quant.int4_quantize(x, 2000, "K")
    assert quant.int4_nbytes((1, 2, 40, 8), 16, "K") != quant.int4_nbytes((1, 2, 40, 8), 8, "V")
    with pytest.raises(IntegrityError, match="payload of"):
        quant.int4_dequantize(quant.int4_quantize(x, 16, "K"), 8, torch.empty_like(x), "V")
