"""The CUDA capability check's decisions (from given facts) and where each side puts the bytes of a
CUDA tensor: device memory when UCX can take it, pinned host staging otherwise. No GPU needed:
CUDA buffers are stand-ins that carry a CUDA device."""

from __future__ import annotations

import math
import types

import pytest
import structlog
import torch
import xxhash

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.transport import capabilities, codecs, integrity, placement, ucx
from droidmesh.shared.transport.capabilities import CudaFacts, CudaSupport, decide
from droidmesh.shared.wire.schemas import PullItem, PullRequest, TensorHeader

SUPPORTED = CudaSupport(True, True, "cuda_copy and cuda_ipc active")
UNSUPPORTED = CudaSupport(False, False, "UCX has no cuda_copy transport")


@pytest.mark.parametrize(("facts", "device_memory", "ipc", "why"), [
    (CudaFacts(False, frozenset({"tcp", "cuda_copy", "cuda_ipc"})), False, False, "no CUDA device"),
    (CudaFacts(True, None, "ModuleNotFoundError: No module named 'ucxx'"), False, False, "ucxx unavailable: Module"),
    (CudaFacts(True, frozenset({"tcp", "sysv", "cma"})), False, False, "no cuda_copy transport"),
    (CudaFacts(True, frozenset({"tcp", "cuda_copy"})), True, False, "without cuda_ipc"),
    (CudaFacts(True, frozenset({"tcp", "cuda_copy", "cuda_ipc"})), True, True, "device-to-device"),
])
def test_decide(facts, device_memory, ipc, why):
    """Device memory needs a CUDA device and UCX's cuda_copy; device-to-device needs cuda_ipc too."""
    support = decide(facts)
    assert (support.device_memory, support.ipc) == (device_memory, ipc) and why in support.reason


def test_support_is_decided_once_from_the_facts(monkeypatch):
    calls = []
    monkeypatch.setattr(capabilities, "cuda_facts", lambda: calls.append(1) or CudaFacts(True, frozenset({"cuda_copy"})))
    capabilities.ucx_cuda_support.cache_clear()
    try:
        assert capabilities.ucx_cuda_support().device_memory and capabilities.ucx_cuda_support().device_memory
        assert calls == [1]
    finally:
        capabilities.ucx_cuda_support.cache_clear()


def test_without_cuda_the_facts_skip_ucx():
    """On this CPU build the check answers without initialising UCX."""
    assert capabilities.cuda_facts() == CudaFacts(False, None, "not checked")


def _cuda_buffer(shape=(2, 4), dtype=torch.float32, contiguous=True):
    return types.SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True, shape=shape, dtype=dtype,
                                 nbytes=math.prod(shape) * dtype.itemsize, is_contiguous=lambda: contiguous)


def _request(codec="raw", params=None):
    return PullRequest(context_id="c", items=[PullItem(0, "K")], codec=codec, codec_params=params or {})


@pytest.fixture
def support(monkeypatch):
    def use(value: CudaSupport) -> None:
        monkeypatch.setattr(capabilities, "ucx_cuda_support", lambda: value)

    monkeypatch.setattr(capabilities, "_NOTED", set())
    return use


def test_receiver_asks_for_device_payloads_only_when_ucx_takes_them(support):
    """Every buffer on CUDA, raw, UCX able: ask. Otherwise the request goes as it was."""
    support(SUPPORTED)
    asked = ucx.ask_device(_request(params={"x": 1}), [_cuda_buffer()])
    assert asked.codec_params == {"x": 1, codecs.DEVICE_PARAM: "cuda"}
    assert ucx.ask_device(_request(), [_cuda_buffer(), torch.empty(2)]).codec_params == {}
    assert ucx.ask_device(_request(codec="toy"), [_cuda_buffer()]).codec_params == {}
    support(UNSUPPORTED)
    assert ucx.ask_device(_request(), [_cuda_buffer()]).codec_params == {}


def test_staging_is_logged_once_with_the_reason(support):
    support(UNSUPPORTED)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            ucx.ask_device(_request(), [_cuda_buffer()])
        ucx.ask_device(_request(), [torch.empty(2)])  # CPU buffers: nothing staged, nothing said
    assert [(e["event"], e["side"], e["reason"]) for e in logs] == [("ucx_cuda_staging", "receiver", UNSUPPORTED.reason)]


def test_sender_drops_the_ask_when_ucx_cannot_send_device_memory(support):
    asked = _request(params={"x": 1, codecs.DEVICE_PARAM: "cuda"})
    support(SUPPORTED)
    assert ucx.honour_device(asked) is asked
    support(UNSUPPORTED)
    assert ucx.honour_device(asked).codec_params == {"x": 1}


def _header(nbytes=32, device=False):
    return TensorHeader(context_id="c", layer=0, kind="K", shape=[2, 4], dtype="float32", codec="raw",
                        codec_params={codecs.DEVICE_PARAM: "cuda"} if device else {}, nbytes=nbytes, checksum="")


RAW = codecs.get("raw")


def test_receive_place():
    """A device payload lands in the CUDA buffer itself; a host payload bound for a CUDA buffer in
    pinned host memory; a CPU buffer takes raw bytes in place."""
    assert placement.receive_place(RAW, _header(device=True), _cuda_buffer()) == "out"
    assert placement.receive_place(RAW, _header(device=True), _cuda_buffer(contiguous=False)) == "device"
    assert placement.receive_place(RAW, _header(16, device=True), _cuda_buffer()) == "device"  # decode refuses the size
    assert placement.receive_place(RAW, _header(), _cuda_buffer()) == "pinned"
    assert placement.receive_place(RAW, _header(), torch.empty(2, 4)) == "out"
    assert placement.receive_place(RAW, _header(), torch.empty(4, 2).t()) == "host"


def test_receive_buffer_on_the_cpu_is_the_buffer_itself():
    out = torch.empty(2, 4)
    assert placement.receive_buffer(RAW, _header(), out).data_ptr() == out.data_ptr()


def test_raw_cpu_tensor_is_its_own_bytes_even_when_asked_for_device_payloads():
    t = torch.randn(2, 4)
    payload, params = RAW.encode(t, {codecs.DEVICE_PARAM: "cuda"})
    assert payload.data_ptr() == t.data_ptr() and params == {}


def test_raw_decode_into_a_non_contiguous_buffer():
    """A staged payload is written into the caller's buffer itself, whatever its strides."""
    src = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    out = torch.zeros(4, 2).t()
    RAW.decode(codecs.payload_view(src).clone(), _header(), out)
    assert torch.equal(out, src)  # bitwise: raw decode copies the bytes
    with pytest.raises(IntegrityError):
        RAW.decode(torch.zeros(16, dtype=torch.uint8), _header(16), out)


def test_device_checksum_detects_changes_and_reorders():
    """Same bytes, same sum (wherever they start); a flipped bit, a swap of words or a missing tail
    changes it."""
    payload = codecs.payload_view(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    base = integrity.device_checksum(payload)
    assert base.startswith("d") and len(base) == 33
    assert integrity.device_checksum(payload.clone()) == base
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]  # same bytes, unaligned
    assert integrity.device_checksum(shifted) == base
    flipped = payload.clone()
    flipped[1234] ^= 1
    words = payload.clone().view(torch.int64)
    words[[3, 7]] = words[[7, 3]]
    for changed in (flipped, words.view(torch.uint8), payload[:-8], payload[:-3]):
        assert integrity.device_checksum(changed) != base


def test_checksum_of_host_bytes_stays_xxh3():
    payload = codecs.payload_view(torch.randn(10))
    assert integrity.checksum(payload) == xxhash.xxh3_64_hexdigest(payload.numpy().tobytes())


def test_device_checksum_does_not_depend_on_the_step_size(monkeypatch):
    payload = codecs.payload_view(torch.randn(999, generator=torch.Generator().manual_seed(1)))
    whole = integrity.device_checksum(payload)
    monkeypatch.setattr(integrity, "_WEIGHTED_WORDS", 7)
    assert integrity.device_checksum(payload) == whole
