"""A NIXL agent with the UCX backend, confined to one worker thread of its own.

The agent is created without locks, so every call on it is made on its thread: `call` (from the
event loop, awaited) and `submit` (a concurrent future) run work there, and every other method
must only run there. Built on NIXL's bindings rather than `nixl_agent` for its progress thread's
idle wait (PROGRESS_IDLE_US: it wakes on UCX events, so this is no latency; `nixl_agent`
hard-codes 0, which spins a whole core per agent even when idle).

The NIXL wheel (`nixl-cu12`, the `mesh` extra) is imported on first use. What a peer sent is
loaded here (`load`) only after `metadata.py` has checked it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from droidmesh.shared.errors import TransferError

T = TypeVar("T")
NIXL_MODULES = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings")  # CUDA 12 / 13 wheels, source build
PROGRESS_IDLE_US = 100_000


def _bindings() -> Any:
    """NIXL's C++ bindings; `TransferError` when no NIXL wheel is installed."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError("the nixl transport needs NIXL: pip install 'droidmesh[mesh]' (nixl-cu12)")


Memory = Literal["DRAM", "VRAM"]  # host memory; a GPU's (with its device number)


def rows(regions: Sequence[tuple[int, int]], device: int = 0) -> np.ndarray:
    """NIXL descriptor rows [n, 3]: (address, length, device)."""
    return np.array([(a, n, device) for a, n in regions], dtype=np.uint64).reshape(-1, 3)


class Agent:
    def __init__(self, role: str):
        self.name = f"droidmesh-{role}-{uuid.uuid4().hex[:12]}"
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"nixl-{role}")
        self._b: Any = None
        self._agent: Any = None
        self._ucx: list[int] = []

    async def start(self) -> None:
        b = self._b = _bindings()

        def create() -> None:
            cfg = b.nixlAgentConfig()
            cfg.useProgThread, cfg.pthrDelay = True, PROGRESS_IDLE_US
            cfg.useListenThread, cfg.syncMode = False, b.NIXL_THREAD_SYNC_NONE  # one thread calls it
            agent = b.nixlAgent(self.name, cfg)
            if "UCX" not in agent.getAvailPlugins():
                raise TransferError("NIXL's UCX plugin is missing from this install")
            self._ucx = [agent.createBackend("UCX", {})]
            self._agent = agent

        await self.call(create)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    def register(self, regions: Sequence[tuple[int, int]], memory: Memory = "DRAM", device: int = 0) -> Any:
        descs = self._b.nixlRegDList(self._segment(memory), rows(regions, device))
        self._agent.registerMem(descs, self._ucx)
        return descs

    def _segment(self, memory: Memory) -> Any:
        return self._b.VRAM_SEG if memory == "VRAM" else self._b.DRAM_SEG

    def deregister(self, descs: Any) -> None:
        self._agent.deregisterMem(descs, self._ucx)

    def metadata(self, regions: Sequence[tuple[int, int]], connection: bool, memory: Memory = "DRAM",
                 device: int = 0) -> bytes:
        """This agent's metadata for exactly `regions` (registered), with or without its
        connection info."""
        descs = self._b.nixlRegDList(self._segment(memory), rows(regions, device))
        return bytes(self._agent.getLocalPartialMD(descs, connection, self._ucx))

    def load(self, metadata: bytes) -> str:
        """Load a peer's (checked) metadata, added to what is loaded for it already; its agent name."""
        name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, peer: str) -> None:
        self._agent.makeConnection(peer, self._ucx)

    def forget(self, peer: str) -> None:
        self._agent.invalidateRemoteMD(peer)

    def read(self, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str) -> tuple[int, str]:
        """Post one READ of `remote` regions of `peer` into `local` ones; (handle, state)."""
        b = self._b
        handle = self._agent.createXferReq(b.NIXL_READ, b.nixlXferDList(b.DRAM_SEG, rows(local)),
                                           b.nixlXferDList(b.DRAM_SEG, rows(remote)), peer, "", self._ucx)
        return handle, self._state(self._agent.postXferReq(handle, ""))

    def state(self, handle: int) -> str:
        return self._state(self._agent.getXferStatus(handle))

    def _state(self, status: Any) -> str:
        return "DONE" if status == self._b.NIXL_SUCCESS else "PROC" if status == self._b.NIXL_IN_PROG else "ERR"

    def release(self, handle: int) -> None:
        self._agent.releaseXferReq(handle)  # cancels a transfer still in progress

    def close(self) -> None:
        """Destroy the agent on its thread, then stop the thread."""
        self._pool.submit(self._destroy).result()
        self._pool.shutdown(wait=True)

    def _destroy(self) -> None:
        self._agent = None
