"""`droidmesh bench sender-loop`: how long a sender's event loop cannot run while it answers pulls.

A sender's loop also grants other receivers' pulls, answers NATS requests and beats its
heartbeat, so the longest it is held by one pull's encoding (quantizing, a first checksum, copying
device memory to the host) is a delay every other request on that sender shares. Here a bulk
server (ucx or nixl, its sandbox processes as in a sender) holds one context of a named shape's
K / V (random bf16, placed as a sender places what it stores) on its own event loop in a thread,
with a ticker beside it that wakes every `TICK_S` and records how late it woke (the loop's lag).
A client on the main thread pulls every layer's K / V with each codec `repeats` times over fresh
connections, after one pull that warms the channel; the stored tensors are re-made before each
pull, so its first checksums are new, as for a newly captured context. Per codec: the pull's
median time, the sender loop's worst and 99th-percentile lag during the pulls (ms), and the
receiving loop's worst (a receiver lands and decodes each item on its loop, with a ticker of its
own here). By default one process (two threads, two loops): each side's work shares the GIL
with the other's loop, so a lag here is an upper bound of a sender's or a receiver's own. With
`client_process` the client runs in a process of its own (one, started once), as a receiver
does: each side's lag is its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from droidmesh.shared.model.device import resolve_device
from droidmesh.shared.tools.bench.hosts import widths
from droidmesh.shared.transport.bulk import BulkServer, make_client, make_server
from droidmesh.shared.wire.schemas import PullItem, PullRequest

TICK_S = 0.001


class _Ticker:
    """Wakes every TICK_S on the loop it runs on; `lags` is how late each wake-up came."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            self.lags.append(max(0.0, time.perf_counter() - due))


class _Sender:
    """A bulk server and a ticker on an event loop of their own thread."""

    def __init__(self, transport: str, make_context: Callable[[], dict[tuple[int, str], torch.Tensor]]):
        self.make_context = make_context
        self.held: dict[tuple[int, str], torch.Tensor] = {}
        self.loop = asyncio.new_event_loop()
        self.ticker = _Ticker()
        self.server: BulkServer = make_server(transport, self._lookup, None)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._ticking = asyncio.run_coroutine_threadsafe(self.ticker.run(), self.loop)
        try:
            self.address = self.call(self.server.start())
        except BaseException:
            self.close()
            raise

    def _lookup(self, context_id: str, layer: int, kind: str) -> torch.Tensor | None:
        return self.held.get((layer, kind)) if context_id == "ctx" else None

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def renew(self) -> None:
        """A newly captured context (its checksums unknown), placed as a sender stores it."""
        fresh = self.make_context()
        self.held = dict(zip(fresh, self.server.place(list(fresh.values())), strict=True))

    def close(self) -> None:
        self.ticker.running = False
        self._ticking.result(10)
        try:
            self.call(self.server.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def measure(transport: str, shape: str, tokens: int, codecs_: list[str], repeats: int, device: str = "cpu",
            progress: Callable[[str], None] = lambda _: None, client_process: bool = False) -> dict:
    """Per codec: median pull seconds and the sender loop's lag (worst, p99) over `repeats` pulls of
    a context held on `device` (a GPU sender's: each item copied to pinned host memory per pull);
    with `client_process`, the pulls from a process of their own."""
    w = widths(shape)
    kv_shape = (1, w.kv_heads, tokens, w.head_dim)  # [1, kvh, T, hd]
    dev = resolve_device(device)

    def make_context() -> dict[tuple[int, str], torch.Tensor]:
        return {(l, k): torch.randn(kv_shape, device=dev).to(torch.bfloat16) for l in range(w.layers) for k in "KV"}

    items = [PullItem(l, kind) for l in range(w.layers) for kind in ("K", "V")]
    rows = []
    client = _Client(client_process)
    sender = _Sender(transport, make_context)
    try:
        sender.renew()
        client.pull(transport, sender.address, items, kv_shape, "raw")  # warm: the first sandbox, UCX's start
        for codec in codecs_:
            seconds, lags, receiving = [], [], []
            for i in range(repeats):
                progress(f"{codec} {i + 1}/{repeats}")
                sender.renew()
                sender.ticker.lags.clear()
                took, client_lags = client.pull(transport, sender.address, items, kv_shape, codec)
                seconds.append(took)
                lags.extend(sender.ticker.lags)
                receiving.extend(client_lags)
            lags.sort()
            rows.append({"codec": codec, "pull_ms": round(statistics.median(seconds) * 1e3, 2),
                         "lag_max_ms": round(lags[-1] * 1e3, 2), "lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))] * 1e3, 2),
                         "ticks": len(lags), "receiver_lag_max_ms": round(max(receiving, default=0.0) * 1e3, 2)})
    finally:
        sender.close()
        client.close()
    nbytes = 2 * w.layers * torch.Size(kv_shape).numel() * 2
    return {"transport": transport, "device": str(dev), "shape": shape, "tokens": tokens, "items": len(items), "raw_bytes": nbytes,
            "tick_s": TICK_S, "repeats": repeats, "client": "process" if client_process else "thread", "rows": rows}


class _Client:
    """Where the pulls run: this process's main thread, or one process of their own (spawned, so
    it starts no copy of the sender's threads)."""

    def __init__(self, own_process: bool):
        self._pool = (concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                      if own_process else None)

    def pull(self, transport: str, address: str, items: list[PullItem], kv_shape: tuple[int, ...],
             codec: str) -> tuple[float, list[float]]:
        if self._pool is None:
            return _pull_now(transport, address, items, kv_shape, codec)
        return self._pool.submit(_pull_now, transport, address, items, kv_shape, codec).result(300)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def _pull_now(transport: str, address: str, items: list[PullItem], kv_shape: tuple[int, ...],
              codec: str) -> tuple[float, list[float]]:
    return asyncio.run(_pull(transport, address, items, kv_shape, codec))


async def _pull(transport: str, address: str, items: list[PullItem], kv_shape: tuple[int, ...],
                codec: str) -> tuple[float, list[float]]:
    """One pull's seconds, and the lags of a ticker on the receiving loop meanwhile (it lands and
    decodes each item there, as a receiver does)."""
    client, ticker = make_client(transport), _Ticker()
    into = [torch.empty(kv_shape, dtype=torch.bfloat16) for _ in items]
    ticking = asyncio.ensure_future(ticker.run())
    try:
        start = time.perf_counter()
        await client.pull(address, PullRequest(context_id="ctx", items=items, codec=codec), into, lambda *a: None, 120)
        return time.perf_counter() - start, ticker.lags
    finally:
        ticker.running = False
        await ticking
        await client.close()


COLUMNS = ["codec", "pull_ms", "lag_max_ms", "lag_p99_ms", "ticks", "receiver_lag_max_ms"]


def title(result: dict) -> str:
    return (f"{result['transport']}, {result['device']}, {result['shape']} at {result['tokens']} tokens: {result['items']} items, "
            f"{result['raw_bytes'] / 2**20:.1f} MiB raw; the sender's loop ticking every {result['tick_s'] * 1e3:.0f} ms")
