"""Where arriving tensors meet the compute: the copy stream (DroidSpeak's pipelining on one GPU).

On CUDA, reused KV and E land in host memory (a channel's pinned staging) or in device staging
and must be copied or decoded into the receiver's device buffers while the recompute group runs.
On the compute stream that copy would queue behind the recompute's kernels and nothing would
overlap. So each device has one copy stream (non-blocking: it never waits for the legacy default
stream), and the sequence per pulled context is:
  1. `empty(...)`   the receiver allocates its device buffers from the copy stream's pool, so the
                    copy stream may write them without waiting for earlier compute;
  2. `landing(d)`   a channel decodes each item inside it, off the compute thread (on its event
                    loop, or a lane thread): the body's CUDA work runs on the copy stream, and
                    the calling thread alone waits on one event for that work (the copy, not the
                    compute queued before it) before delivering the item: no device-wide sync;
  3. `adopt(t)`     the engine, as it reads a delivered tensor on its compute stream, marks the
                    tensor used there, so its memory returns to the copy stream's pool only after
                    the compute that reads it has run.
On the CPU all three are plain: there is one stream of execution, and a landed tensor is ready.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """`device`'s copy stream, made on first use (any thread; does not block)."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
    return stream


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized buffer for arriving data on `device` (called by the receiver's pull as it
    allocates; does not block). On CUDA it comes from the copy stream's pool (step 1)."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.stream(copy_stream(device)):
        return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def landing(device: torch.device) -> Iterator[None]:
    """Run the body's work for a buffer on `device` on its copy stream; on exit, block the calling
    thread (a channel's event loop or lane, never the compute thread) until that work is done
    (step 2)."""
    if device.type != "cuda":
        yield
        return
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        yield
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()


def adopt(t: torch.Tensor) -> torch.Tensor:
    """`t`, marked as used by the calling thread's current stream (the engine, as it reads a
    delivered tensor; does not block). Without it the copy stream could reuse `t`'s memory while
    compute queued on another stream still reads it (step 3)."""
    if t.device.type == "cuda":
        t.record_stream(torch.cuda.current_stream(t.device))
    return t
