"""CUDA tensors over the bulk channels (skipped without CUDA): the raw codec's device handling,
the device checksum on the GPU, and pulls between two processes on one GPU through UCX, device to
device when UCX has its CUDA transports and staged through pinned host memory when it lacks them.
The two-process pulls run `shared.tools.bench.gpu_transfer` in a child, so that each runs with its own
`UCX_TLS` (UCX is configured once per process); each pull there passes its checksum."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from droidmesh.shared.transport import codecs, integrity, placement
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.wire.schemas import PullItem, PullRequest, TensorHeader

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
RAW = codecs.get("raw")


def _header(t: torch.Tensor, params: dict) -> TensorHeader:
    return TensorHeader(context_id="c", layer=0, kind="K", shape=list(t.shape), dtype="bfloat16", codec="raw",
                        codec_params=params, nbytes=t.numel() * t.element_size(), checksum="")


def test_raw_encode_gives_device_bytes_only_when_asked():
    t = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
    own, params = RAW.encode(t, {codecs.DEVICE_PARAM: "cuda"})
    assert own.data_ptr() == t.data_ptr() and params == {codecs.DEVICE_PARAM: "cuda"}
    staged, params = RAW.encode(t, {})
    assert staged.device.type == "cpu" and staged.is_pinned() and params == {}
    assert torch.equal(staged, codecs.payload_view(t).cpu())  # bitwise: a staged copy of the bytes


def test_raw_lands_device_payloads_in_place_and_host_payloads_via_pinned_memory():
    t = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(t)
    recv = placement.receive_buffer(RAW, _header(t, {codecs.DEVICE_PARAM: "cuda"}), out)
    assert recv.data_ptr() == out.data_ptr()
    staged = placement.receive_buffer(RAW, _header(t, {}), out)
    assert staged.device.type == "cpu" and staged.is_pinned()
    staged.copy_(codecs.payload_view(t).cpu())
    RAW.decode(staged, _header(t, {}), out)
    assert torch.equal(out, t)  # bitwise: copied through pinned memory


def test_device_checksum_is_the_same_on_gpu_and_cpu():
    """Integer sums wrap the same way in any reduction order: one value for the same bytes."""
    payload = codecs.payload_view(torch.randn(3 << 20, device="cuda"))
    assert integrity.checksum(payload) == integrity.device_checksum(payload.cpu())
    corrupted = payload.clone()
    corrupted[12345] ^= 4
    assert integrity.checksum(corrupted) != integrity.checksum(payload)


def test_inproc_channel_stages_cuda_tensors_through_host_memory():
    stored = torch.randn(1, 2, 33, 8, device="cuda")
    into = [torch.empty_like(stored)]

    async def run() -> None:
        server = make_server("inproc", lambda c, l, k: stored, None, name="cuda")
        address = await server.start()
        try:
            await make_client("inproc").pull(address, PullRequest(context_id="c", items=[PullItem(0, "K")]), into,
                                             lambda *a: None, 10)
        finally:
            await server.close()

    asyncio.run(run())
    assert torch.equal(into[0], stored)  # bitwise: staged through host memory: copies


def _transfer(tmp_path: Path, tls: str) -> dict:
    out = tmp_path / f"{tls}.json"
    proc = subprocess.run([sys.executable, "-m", "droidmesh.shared.tools.bench.gpu_transfer", "--sizes", "4096,8388608", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, env={**os.environ, "UCX_TLS": tls},
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode in (0, 2), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    if any("ucxx" in m for m in report["missing"]):
        pytest.skip(f"ucxx unavailable: {report['missing']}")
    assert report["missing"] == [], proc.stdout
    assert all(r["pull_gb_s"] > 0 for r in report["rows"])
    return report


@pytest.mark.xfail(reason="a ucx sender's sandbox maps host memfds only: a CUDA store's payloads are staged "
                          "through host memory until device memory reaches sandboxes (CUDA IPC)", strict=False)
def test_two_processes_pull_device_to_device_with_cuda_transports(tmp_path):
    report = _transfer(tmp_path, "tcp,sm,self,cuda_copy,cuda_ipc")
    assert report["ucx_cuda"]["device_memory"], report["ucx_cuda"]["reason"]
    assert report["rows"][-1]["ucx_memory"].startswith("cuda")  # UCX sent device memory


def test_two_processes_stage_through_pinned_memory_without_cuda_transports(tmp_path):
    report = _transfer(tmp_path, "tcp,sm,self")
    assert not report["ucx_cuda"]["device_memory"] and "cuda_copy" in report["ucx_cuda"]["reason"]
    assert report["path"] == "staged through pinned host memory"
    assert report["rows"][-1]["ucx_memory"] == "host memory"
