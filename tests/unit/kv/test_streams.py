"""The copy stream: every channel lands items through it, the engine adopts what it reads; on
CUDA (`gpu` tests) a landing copies while the compute stream is still busy."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from droidmesh.shared.kv import streams
from droidmesh.shared.kv.blocks import KVBlock
from droidmesh.shared.kv.sources import ArrivingSource
from droidmesh.shared.model.fingerprint import ArchFingerprint
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.bulk import Landing, make_client, make_server
from droidmesh.shared.wire.schemas import PullItem, PullRequest, TensorHeader

STORED = {(l, k): torch.full((1, 2, 7, 4), float(10 * l + (k == "V")), dtype=torch.float32)
          for l in range(3) for k in ("K", "V")}
ITEMS = [PullItem(l, k) for l in range(3) for k in ("K", "V")]


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order: each landing's entry and exit (with its device) and each delivery."""
    seen: list[str] = []
    plain = streams.landing

    @contextlib.contextmanager
    def recorded(device: torch.device):
        seen.append(f"enter {device.type}")
        with plain(device):
            yield
        seen.append("exit")

    monkeypatch.setattr(streams, "landing", recorded)
    return seen


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_every_item_is_decoded_inside_a_landing_before_it_is_delivered(transport, events):
    """Each pulled item is decoded inside `streams.landing` on its buffer's device, then delivered
    (buffers that are not contiguous, so every payload is staged and decoded: one received in
    place has nothing to decode)."""
    into = [torch.empty(1, 7, 2, 4).transpose(1, 2) for _ in ITEMS]  # [1, 2, 7, 4], not contiguous

    async def run() -> None:
        server = make_server(transport, lambda c, l, k: STORED[(l, k)], None)
        address = await server.start()
        client = make_client(transport)
        try:
            await client.pull(address, PullRequest(context_id="c", items=ITEMS), into,
                              lambda it, t: events.append(f"deliver {it.layer}{it.kind}"), 10)
        finally:
            await client.close()
            await server.close()

    asyncio.run(run())
    assert events == [e for it in ITEMS for e in ("enter cpu", "exit", f"deliver {it.layer}{it.kind}")]
    # bitwise: raw landings copy the stored bytes
    assert all(torch.equal(t, STORED[(it.layer, it.kind)]) for it, t in zip(ITEMS, into, strict=True))


def test_the_engine_adopts_every_tensor_it_reads(monkeypatch: pytest.MonkeyPatch):
    """An arriving source's reads mark K, V and E used on the reading thread's stream."""
    adopted: list[torch.Tensor] = []
    monkeypatch.setattr(streams, "adopt", lambda t: adopted.append(t) or t)
    fp = ArchFingerprint(model_type="llama", num_layers=1, hidden_size=4, num_heads=1, num_kv_heads=1,
                         head_dim=4, rope="{}", vocab_hash="v")
    source = ArrivingSource((1, 2), fp)
    k, v, e = torch.zeros(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 2, 4)
    source.put_kv(KVBlock(0, k, v))
    source.put_e(0, e)
    deadline = time.monotonic() + 1
    source.kv(0, deadline)
    source.e(0, deadline)
    assert [id(t) for t in adopted] == [id(k), id(v), id(e)]


def test_on_the_cpu_buffers_and_landings_are_plain():
    """Without CUDA: `empty` allocates where asked, a landing only runs its body, `adopt` is identity."""
    t = streams.empty((2, 3), torch.bfloat16, torch.device("cpu"))
    ran = []
    with streams.landing(torch.device("cpu")):
        ran.append(True)
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and ran == [True] and streams.adopt(t) is t


@pytest.mark.gpu
def test_a_landing_copies_on_the_copy_stream_while_compute_is_busy():
    """A pinned payload lands in a CUDA buffer and is ready while the compute stream still runs."""
    device = torch.device("cuda", torch.cuda.current_device())
    value = torch.randn(1, 8, 4096, 128)  # [1, kvh, T, hd] float32, 16 MiB
    out = streams.empty(tuple(value.shape), value.dtype, device)
    header = TensorHeader(context_id="c", layer=0, kind="K", shape=list(value.shape), dtype="float32",
                          codec="raw", codec_params={}, nbytes=value.numel() * 4, checksum="")
    staged = codecs.payload_view(value).pin_memory()
    compute = torch.cuda.current_stream(device)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy kernel on the compute stream
    Landing(PullItem(0, "K"), header, codecs.get("raw"), out, "pinned", staged).land(verify=False)
    assert not compute.query(), "the landing waited for the compute stream"
    streams.adopt(out)
    assert torch.equal(out.cpu(), value)  # bitwise: the landing copies the bytes


@pytest.mark.gpu
def test_a_buffer_adopted_by_compute_is_not_reused_before_that_compute_ran():
    """Freed after `adopt`, a buffer's memory is not handed to the copy stream while compute reads it."""
    device = torch.device("cuda", torch.cuda.current_device())
    out = streams.empty((1 << 20,), torch.float32, device)
    streams.adopt(out)
    torch.cuda._sleep(1_000_000_000)
    ptr = out.data_ptr()
    del out
    again = streams.empty((1 << 20,), torch.float32, device)
    assert again.data_ptr() != ptr
    torch.cuda.synchronize(device)
